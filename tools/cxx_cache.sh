#!/bin/sh
# tools/compile_cache.py as a C++ compiler (setup.py's compile_through_cache names one executable): the real one is
# COMPILE_CACHE_CXX, else c++.
exec python3 "$(dirname "$0")/compile_cache.py" --compiler "${COMPILE_CACHE_CXX:-c++}" "$@"
