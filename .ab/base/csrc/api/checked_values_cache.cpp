// values_to_check / remember_checked (checked_values_cache.h): a small ring of tensors whose values passed a check,
// each held by a weak reference (the TensorImpl cannot be freed and its address reused while the entry lives) with
// its version counter (any in-place change bumps it) and data pointer.
#include "checked_values_cache.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(FLASH_WITH_CUDA)
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace flash::api {
namespace {

// Tensors remembered at once: a model's step passes a handful (cu_seqlens q / k, cache lengths); the oldest is
// forgotten first and then costs one more synchronisation.
constexpr size_t kRememberedTensors = 32;
constexpr int64_t kNoVersion = -1;  // inference tensors have no version counter: identity and data pointer only

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Entry {
  WeakImpl impl;
  const c10::TensorImpl* address;
  int64_t version;
  const void* data;
  Requirement requirement;
};

struct Remembered {
  std::mutex mutex;
  std::vector<Entry> entries;
  size_t next = 0;
};

Remembered& remembered_checks() {
  static Remembered* remembered = new Remembered();  // never destroyed: may be used during interpreter shutdown
  return *remembered;
}

int64_t version_of(const at::Tensor& t) { return t.is_inference() ? kNoVersion : static_cast<int64_t>(t._version()); }

bool same_tensor(const Entry& entry, const at::Tensor& t, const Requirement& requirement) {
  return entry.address == t.unsafeGetTensorImpl() && !entry.impl.expired() && entry.version == version_of(t) &&
         entry.data == t.const_data_ptr() && entry.requirement == requirement;
}

bool checks_disabled() {
  const char* value = std::getenv(kCheckDeviceValuesEnv);
  return value != nullptr && std::strcmp(value, "0") == 0;
}

bool capturing(const at::Tensor& t) {
#if defined(FLASH_WITH_CUDA)
  return t.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)t;
  return false;
#endif
}

}  // namespace

bool remembered_check(const at::Tensor& t, const Requirement& requirement) {
  if (t.is_cpu()) return false;
  Remembered& cache = remembered_checks();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  for (const Entry& entry : cache.entries) {
    if (same_tensor(entry, t, requirement)) return true;
  }
  return false;
}

std::optional<at::Tensor> values_to_check(const at::Tensor& t, const Requirement& requirement) {
  if (t.is_cpu()) return t.contiguous();
  if (remembered_check(t, requirement) || checks_disabled() || capturing(t)) return std::nullopt;
  return t.to(at::kCPU).contiguous();  // copies on the current stream, then waits for it
}

void remember_checked(const at::Tensor& t, const Requirement& requirement) {
  if (t.is_cpu()) return;
  Entry entry{WeakImpl(t.getIntrusivePtr()), t.unsafeGetTensorImpl(), version_of(t), t.const_data_ptr(),
              requirement};
  Remembered& cache = remembered_checks();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.entries.size() < kRememberedTensors) {
    cache.entries.push_back(std::move(entry));
  } else {
    cache.entries[cache.next] = std::move(entry);
    cache.next = (cache.next + 1) % kRememberedTensors;
  }
}

}  // namespace flash::api
