# tests/model/gguf.cmake: the GGUF reader of libtandem_model (model/gguf.c, gguf-meta.c, the
# type table of model/file.c and the block types' widening, moe/quant.c) as a static library,
# and its suite (tests/test-gguf.c).
# include()d from tests/CMakeLists.txt, where tandem_test_suite is defined.
#
# The cases that read a real GGUF file need the fixture that tests/model/gguf_fixture.py
# writes with the pinned gguf package; a ctest setup test writes it afresh before them. Where
# the Python is missing, or lacks numpy or gguf, that test is skipped and writes nothing, and
# those cases skip in turn (77). The cases that build their files byte by byte need neither.

# Static and position-independent, so that the shared libtandem_model can take it in whole.
add_library(tandem_model_gguf STATIC
  ${PROJECT_SOURCE_DIR}/model/file.c
  ${PROJECT_SOURCE_DIR}/model/quant.c
  ${PROJECT_SOURCE_DIR}/model/gguf.c
  ${PROJECT_SOURCE_DIR}/model/gguf-meta.c
  ${PROJECT_SOURCE_DIR}/moe/quant.c)
set_source_files_properties(${PROJECT_SOURCE_DIR}/moe/quant.c ${PROJECT_SOURCE_DIR}/model/quant.c
  PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
set_target_properties(tandem_model_gguf PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(tandem_model_gguf
  PUBLIC ${PROJECT_SOURCE_DIR}/model ${PROJECT_SOURCE_DIR}/include)
target_link_libraries(tandem_model_gguf PUBLIC tandem)

# cJSON (libcjson-dev) reads the fixture's sidecar; model/CMakeLists.txt and
# tests/model/safetensors.cmake look for it under the same cache names.
find_path(CJSON_INCLUDE_DIR cjson/cJSON.h)
find_library(CJSON_LIB cjson)
if(NOT CJSON_INCLUDE_DIR OR NOT CJSON_LIB)
  message(STATUS "tandem: cJSON not found (libcjson-dev); no gguf suite")
  return()
endif()

# mutants opens a few thousand files: about 1 s, 2-3 s under ASan.
tandem_test_suite(gguf DEVICES cpu:0 SOURCES test-gguf LONG mutants 300)
target_link_libraries(test-gguf PRIVATE tandem_model_gguf ${CJSON_LIB})
target_include_directories(test-gguf PRIVATE ${CJSON_INCLUDE_DIR})

# The Python with the pinned gguf package (scripts/bootstrap's venv). Another model cmake file
# may set it first.
if(NOT DEFINED TANDEM_VENV_PYTHON)
  set(TANDEM_VENV_PYTHON ${PROJECT_SOURCE_DIR}/build-venv/bin/python CACHE FILEPATH
      "Python with the pinned gguf and safetensors packages, for the model tests' fixtures")
endif()

set(_gguf_fixture_dir ${CMAKE_CURRENT_BINARY_DIR}/model-gguf)
add_test(NAME gguf.cpu.fixture COMMAND sh -c
  "rm -f \"$2/gguf-fixture.gguf\" \"$2/gguf-fixture.json\"; test -x \"$0\" || \
{ echo \"SKIP: no Python at $0 (TANDEM_VENV_PYTHON)\"; exit 77; }; exec \"$0\" \"$1\" \"$2\""
  ${TANDEM_VENV_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/gguf_fixture.py ${_gguf_fixture_dir})
set_tests_properties(gguf.cpu.fixture PROPERTIES
  FIXTURES_SETUP tandem_gguf_fixture
  SKIP_RETURN_CODE 77
  LABELS cpu
  TIMEOUT 120)

get_property(_gguf_tests DIRECTORY PROPERTY TESTS)
list(FILTER _gguf_tests INCLUDE REGEX "^gguf\\.")
list(REMOVE_ITEM _gguf_tests gguf.cpu.fixture)
set_tests_properties(${_gguf_tests} PROPERTIES FIXTURES_REQUIRED tandem_gguf_fixture)
set_property(TEST ${_gguf_tests} APPEND PROPERTY ENVIRONMENT
  "TANDEM_TEST_GGUF=${_gguf_fixture_dir}/gguf-fixture.gguf")
unset(_gguf_fixture_dir)
unset(_gguf_tests)
