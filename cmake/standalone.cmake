# A plain CMake build (`cmake --preset release`, no pip): scikit-build-core is not
# there to point CMake at pybind11 and cython-cmake, so ask the Python that
# find_package(Python) found (the active venv first) where its site-packages are.
# Needs `pip install pybind11 cython cython-cmake` in that environment.
if(SKBUILD)
  return()
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
  OUTPUT_VARIABLE ATTN_PY_SITE OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _attn_rc)
if(NOT _attn_rc EQUAL 0)
  message(FATAL_ERROR "${Python_EXECUTABLE} could not name its site-packages")
endif()
list(APPEND CMAKE_PREFIX_PATH "${ATTN_PY_SITE}")  # pybind11/share/cmake/pybind11
if(EXISTS "${ATTN_PY_SITE}/cython_cmake/cmake/FindCython.cmake")
  list(APPEND CMAKE_MODULE_PATH "${ATTN_PY_SITE}/cython_cmake/cmake")
else()
  message(FATAL_ERROR "cython-cmake is not installed for ${Python_EXECUTABLE}: "
                      "pip install pybind11 cython cython-cmake (or build with pip install .)")
endif()
