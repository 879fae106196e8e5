// FLASH_CHECK(cond, parts...) / FLASH_FAIL(parts...): TORCH_CHECK with the message built by string concatenation instead of
// iostreams. Measured on the H200 machine (torch 2.11, GCC 13.3): formatting a number through std::ostream
// inside this extension segfaulted in libstdc++'s locale code, so nothing here touches a stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace flash::api {

inline std::string to_text(const char* text) { return text; }
inline std::string to_text(const std::string& text) { return text; }
inline std::string to_text(bool value) { return value ? "true" : "false"; }
inline std::string to_text(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}
template <typename Int, std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>, int> = 0>
std::string to_text(Int value) {
  return std::to_string(value);
}
inline std::string to_text(c10::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}
inline std::string to_text(const std::vector<int64_t>& sizes) { return to_text(c10::IntArrayRef(sizes)); }
inline std::string to_text(c10::ScalarType type) { return c10::toString(type); }
inline std::string to_text(const c10::Device& device) { return device.str(); }

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string text;
  (text += ... += to_text(parts));
  return text;
}

}  // namespace flash::api

#define FLASH_FAIL(...) TORCH_CHECK(false, ::flash::api::message(__VA_ARGS__))

#define FLASH_CHECK(cond, ...)                                  \
  do {                                                          \
    if (C10_UNLIKELY(!(cond))) {                                \
      TORCH_CHECK(false, ::flash::api::message(__VA_ARGS__));   \
    }                                                           \
  } while (false)
