# cmake/sycl.cmake: the SYCL backend module, libtandem-sycl.so, from src/sycl/*.c and *.cpp: C11,
# and host-only C++17 built by the system C++ compiler (no SYCL compiler) against the headers
# and libsycl of PyPI's intel-sycl-rt, which scripts/bootstrap installs into a cache folder
# outside the clone.
# Included from the top CMakeLists.txt after the OpenCL module: it links the same OpenCL
# (the module makes OpenCL user events through SYCL's OpenCL interop).
#
# Reads:  TANDEM_SYCL        auto (build it where the runtime and src/sycl/ are found), on
#                            (fail if not), off; its default is $TANDEM_SYCL, as for the bootstrap.
#         TANDEM_SYCL_ROOT   the runtime's folder (<root>/include/sycl/sycl.hpp,
#                            <root>/lib/libsycl.so); default $TANDEM_SYCL_ROOT, else the
#                            bootstrap's folder. A relative path is relative to the source tree.
# Sets:   TANDEM_HAVE_SYCL      ON where the target tandem-sycl is built, and with it the
#                               imported target TandemSYCL::sycl (libsycl, its headers as
#                               SYSTEM, SYCL_DISABLE_FSYCL_SYCLHPP_WARNING).
#         TANDEM_SYCL_ROOT_DIR  the folder looked in (absolute).
#         TANDEM_SYCL_TEST_ENV  the ENVIRONMENT entries of every test on sycl:0: its own ICD
#                               folder (<root>/icd, written by the bootstrap), so that SYCL sees
#                               Intel's OpenCL CPU device rather than PoCL, which has no USM.

if(DEFINED ENV{TANDEM_SYCL} AND NOT "$ENV{TANDEM_SYCL}" STREQUAL "")
  set(_sycl_default "$ENV{TANDEM_SYCL}")
else()
  set(_sycl_default auto)
endif()
set(TANDEM_SYCL ${_sycl_default} CACHE STRING
    "Build the SYCL backend module: auto (where its runtime is found), on, off")
set_property(CACHE TANDEM_SYCL PROPERTY STRINGS auto on off)
string(TOLOWER "${TANDEM_SYCL}" _sycl_mode)
if(NOT _sycl_mode MATCHES "^(auto|on|off)$")
  message(FATAL_ERROR "TANDEM_SYCL must be auto, on or off (it is \"${TANDEM_SYCL}\")")
endif()
set(TANDEM_SYCL_ROOT "" CACHE PATH
    "The SYCL runtime's folder (empty: $TANDEM_SYCL_ROOT, else where scripts/bootstrap puts it)")

# The bootstrap's folder is named by the version it pins (sycl_version=... in the script).
set(_sycl_bootstrap ${PROJECT_SOURCE_DIR}/scripts/bootstrap)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_sycl_bootstrap})
file(STRINGS ${_sycl_bootstrap} _sycl_version REGEX "^sycl_version=[0-9.]+$")
string(REGEX REPLACE "^sycl_version=" "" _sycl_version "${_sycl_version}")
if(NOT _sycl_version MATCHES "^[0-9.]+$")
  message(FATAL_ERROR "no sycl_version=<version> line in ${_sycl_bootstrap}")
endif()
if(NOT TANDEM_SYCL_ROOT STREQUAL "")
  set(_sycl_root "${TANDEM_SYCL_ROOT}")
elseif(DEFINED ENV{TANDEM_SYCL_ROOT} AND NOT "$ENV{TANDEM_SYCL_ROOT}" STREQUAL "")
  set(_sycl_root "$ENV{TANDEM_SYCL_ROOT}")
elseif(DEFINED ENV{XDG_CACHE_HOME} AND NOT "$ENV{XDG_CACHE_HOME}" STREQUAL "")
  set(_sycl_root "$ENV{XDG_CACHE_HOME}/tandem/sycl-${_sycl_version}")
else()
  set(_sycl_root "$ENV{HOME}/.cache/tandem/sycl-${_sycl_version}")
endif()
get_filename_component(TANDEM_SYCL_ROOT_DIR "${_sycl_root}" ABSOLUTE BASE_DIR ${PROJECT_SOURCE_DIR})
set(TANDEM_SYCL_TEST_ENV "OCL_ICD_VENDORS=${TANDEM_SYCL_ROOT_DIR}/icd")
# Under ThreadSanitizer: Intel's runtime is not instrumented, and its threads (TBB's, and the
# copies its compiled builtins make, whose frames have no module name to suppress by) order
# their accesses with synchronization TSan cannot see; accesses its interceptors see coming
# from modules that are not instrumented are not taken as races. tandem's own code still is.
if(TANDEM_SANITIZE STREQUAL "thread")
  list(APPEND TANDEM_SYCL_TEST_ENV
       "TSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/tsan.supp ignore_noninstrumented_modules=1")
endif()

# CONFIGURE_DEPENDS: a source added to src/sycl/ re-runs cmake by itself.
file(GLOB _sycl_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/sycl/*.c
                                          ${PROJECT_SOURCE_DIR}/src/sycl/*.cpp)
set(TANDEM_HAVE_SYCL OFF)
if(_sycl_mode STREQUAL "off")
  set(_sycl_why "TANDEM_SYCL=off")
elseif(NOT EXISTS ${TANDEM_SYCL_ROOT_DIR}/include/sycl/sycl.hpp
       OR NOT EXISTS ${TANDEM_SYCL_ROOT_DIR}/lib/libsycl.so)
  string(CONCAT _sycl_why "no SYCL runtime in ${TANDEM_SYCL_ROOT_DIR}: run scripts/bootstrap, "
         "or set TANDEM_SYCL_ROOT to a folder with include/sycl/sycl.hpp and lib/libsycl.so")
elseif(NOT _sycl_sources)
  set(_sycl_why "no sources in src/sycl/")
elseif(NOT OpenCL_FOUND)
  set(_sycl_why "OpenCL not found (the module links it)")
else()
  set(TANDEM_HAVE_SYCL ON)
endif()

if(TANDEM_HAVE_SYCL)
  enable_language(CXX)
  # The include folder of an imported target is SYSTEM: the SYCL headers' own warnings are not
  # the module's. The headers warn when compiled without -fsycl, as here by design. libsycl is
  # linked by name, with the runtime's lib/ folder on the rpath of what links it (linked by
  # its path, CMake would warn for every target that links OpenCL too). That folder has a
  # libOpenCL.so.1 of its own, which does not find its own dependencies when a program's rpath
  # loads it at start-up: link this into shared libraries and modules, not into a program that
  # needs libOpenCL.so.1 (tests/CMakeLists.txt puts the tests' sycl:: calls in a library).
  add_library(TandemSYCL::sycl INTERFACE IMPORTED)
  set_target_properties(TandemSYCL::sycl PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES ${TANDEM_SYCL_ROOT_DIR}/include
    INTERFACE_COMPILE_DEFINITIONS SYCL_DISABLE_FSYCL_SYCLHPP_WARNING
    INTERFACE_LINK_OPTIONS
      "-L${TANDEM_SYCL_ROOT_DIR}/lib;LINKER:-rpath,${TANDEM_SYCL_ROOT_DIR}/lib"
    INTERFACE_LINK_LIBRARIES -lsycl)
  add_library(tandem-sycl MODULE ${_sycl_sources})
  target_include_directories(tandem-sycl PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/include
                                                 ${CMAKE_CURRENT_SOURCE_DIR}/src)
  # The C files get the project's C warnings; the C++ file the same.
  target_compile_options(tandem-sycl PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow -Wno-unused-parameter>)
  target_link_libraries(tandem-sycl PRIVATE TandemSYCL::sycl OpenCL::OpenCL Threads::Threads
                                            ${CMAKE_DL_LIBS})
  # Only what is marked visibility("default") is exported: tdm_backend_module, as in the
  # other modules. libsycl and its dependencies are found through the rpath, the runtime's lib/
  # folder alone, in the build tree and installed alike (an installed module still needs that
  # folder): the module needs nothing of the build tree, so it is linked with its install rpath
  # and installed as it is.
  set_target_properties(tandem-sycl PROPERTIES PREFIX "lib"
    LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
    CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
    INSTALL_RPATH ${TANDEM_SYCL_ROOT_DIR}/lib
    BUILD_WITH_INSTALL_RPATH ON)
  install(TARGETS tandem-sycl LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  message(STATUS
    "tandem: building the SYCL backend module (SYCL runtime in ${TANDEM_SYCL_ROOT_DIR})")
  # Building libtandem builds the module too.
  add_dependencies(tandem tandem-sycl)
else()
  if(_sycl_mode STREQUAL "on")
    message(FATAL_ERROR "TANDEM_SYCL=on, but ${_sycl_why}")
  endif()
  # A module left by an earlier configure of this build tree would still be loaded by the tests.
  file(REMOVE ${CMAKE_BINARY_DIR}/libtandem-sycl.so)
  message(STATUS "tandem: no SYCL backend: ${_sycl_why}; the tests on sycl:0 are skipped")
endif()
