# CMake toolchain of the emulation harness (tools/arm/emulate.sh): Debian's
# aarch64-linux-gnu cross compiler on an x86-64 host. Headers and libraries of
# the target come from the cross toolchain's own sysroot; the Python headers
# from the arm64 root (emulate.sh passes Python_INCLUDE_DIR, and the root's
# /usr/include after the toolchain's for pyconfig.h's multiarch half); build tools
# (Python for Cython and pybind11's CMake files) from the host.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
