"""Loads flash_attn's compiled extension, the top-level module `flash_attn_C` (op schemas, CPU and CUDA kernels).
It is top-level rather than `flash_attn._C` so that a source checkout on sys.path (python run from the repository
root) still finds the installed build: the checkout's flash_attn/ shadows the installed package's folder, not a
module beside it. A missing or mismatched build raises ImportError saying what to run."""

from __future__ import annotations

from . import __version__

EXTENSION = "flash_attn_C"
_BUILD_LINE = "pip install --no-build-isolation ."


def _load():
    try:
        import flash_attn_C
    except ModuleNotFoundError as error:
        if error.name != EXTENSION:
            raise
        raise ImportError(
            f"flash_attn: the compiled extension ({EXTENSION}) is not installed, so this source tree cannot run. "
            f"Build and install it from the repository root with `{_BUILD_LINE}` (torch and ninja installed first; "
            "README, Setup), then import flash_attn again.") from None
    except ImportError as error:
        raise ImportError(
            f"flash_attn: the compiled extension ({EXTENSION}) failed to load: {error}. It was probably built against "
            f"another torch; rebuild it with `{_BUILD_LINE}` from the repository root.") from error
    built = getattr(flash_attn_C, "__version__", None)
    if built != __version__:
        raise ImportError(
            f"flash_attn: the installed extension {EXTENSION} ({flash_attn_C.__file__}) was built from flash_attn "
            f"{built}, but this flash_attn is {__version__}. Rebuild it with `{_BUILD_LINE}` from the repository root.")
    return flash_attn_C


C = _load()
