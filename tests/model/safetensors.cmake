# tests/model/safetensors.cmake: the safetensors + config.json reader of libtandem_model
# (model/safetensors.c) as a static library, and its suite (tests/test-safetensors.c) over the
# model folder that tests/model/st_fixture.py writes with the pinned safetensors package.
# include()d from tests/CMakeLists.txt, where tandem_test_suite is defined.

# cJSON (libcjson-dev) parses the headers and config.json; without it there is no reader to
# test (model/CMakeLists.txt looks for it the same way, under the same cache names).
find_path(CJSON_INCLUDE_DIR cjson/cJSON.h)
find_library(CJSON_LIB cjson)
if(NOT CJSON_INCLUDE_DIR OR NOT CJSON_LIB)
  message(STATUS "tandem: cJSON not found (libcjson-dev); no safetensors suite")
  return()
endif()

# Static and position-independent, so that the shared libtandem_model can take it in whole.
add_library(tandem_model_st STATIC ${PROJECT_SOURCE_DIR}/model/safetensors.c)
set_target_properties(tandem_model_st PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(tandem_model_st
  PUBLIC ${PROJECT_SOURCE_DIR}/model ${PROJECT_SOURCE_DIR}/include ${CJSON_INCLUDE_DIR})
target_link_libraries(tandem_model_st PUBLIC tandem PRIVATE ${CJSON_LIB} m)

tandem_test_suite(safetensors DEVICES cpu:0 SOURCES test-safetensors)
target_link_libraries(test-safetensors PRIVATE tandem_model_st ${CJSON_LIB})

# The Python that has the pinned safetensors package (scripts/bootstrap's venv). Another model
# cmake file may set it first.
if(NOT DEFINED TANDEM_VENV_PYTHON)
  set(TANDEM_VENV_PYTHON ${PROJECT_SOURCE_DIR}/build-venv/bin/python CACHE FILEPATH
      "Python with the pinned gguf and safetensors packages, for the model tests' fixtures")
endif()

# The fixture: written afresh before the suite's cases run. Where the Python is missing, or
# lacks numpy or safetensors (st_fixture.py exits 77), it is skipped and leaves no folder, and
# every case skips in turn (exit 77): tests/test-safetensors.c looks for expected.json.
set(_st_fixture_dir ${CMAKE_CURRENT_BINARY_DIR}/model-st)
add_test(NAME safetensors.cpu.fixture COMMAND sh -c
  "rm -rf \"$2\"; test -x \"$0\" || { echo \"SKIP: no Python at $0 (TANDEM_VENV_PYTHON)\"; \
exit 77; }; exec \"$0\" \"$1\" \"$2\""
  ${TANDEM_VENV_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/st_fixture.py ${_st_fixture_dir})
set_tests_properties(safetensors.cpu.fixture PROPERTIES
  FIXTURES_SETUP tandem_st_fixture
  SKIP_RETURN_CODE 77
  LABELS cpu
  TIMEOUT 120)

get_property(_st_tests DIRECTORY PROPERTY TESTS)
list(FILTER _st_tests INCLUDE REGEX "^safetensors\\.")
list(REMOVE_ITEM _st_tests safetensors.cpu.fixture)
set_tests_properties(${_st_tests} PROPERTIES FIXTURES_REQUIRED tandem_st_fixture)
set_property(TEST ${_st_tests} APPEND PROPERTY ENVIRONMENT
  "TANDEM_TEST_ST_DIR=${_st_fixture_dir}")
