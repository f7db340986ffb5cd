# capi/: the C API dump writer used from C and from C++, checked by diffrun validate, h5py and diffrun compare; and installed for find_package and pkg-config consumers.
add_executable(test_capi_c capi/test_capi_c.c)
set_target_properties(test_capi_c PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
target_compile_options(test_capi_c PRIVATE -Wall -Wextra -pedantic)
target_link_libraries(test_capi_c PRIVATE diffrun::dump_writer)
add_executable(test_capi_cpp capi/test_capi_cpp.cpp)
target_link_libraries(test_capi_cpp PRIVATE diffrun::dump_writer hdf5::hdf5 diffrun_warnings)

# The same API from Rust (extern "C", no crates), where rustc is installed (scripts/setup --tests installs it).
find_program(DIFFRUN_RUSTC rustc)
set(diffrun_capi_rust "")
if(DIFFRUN_RUSTC)  # a rustup shim without a toolchain is found but cannot run: ask it first
  execute_process(COMMAND ${DIFFRUN_RUSTC} --version RESULT_VARIABLE diffrun_rustc_rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT diffrun_rustc_rc EQUAL 0)
    message(STATUS "${DIFFRUN_RUSTC} --version failed: the Rust C API test skips")
    set(DIFFRUN_RUSTC "")
  endif()
endif()
if(DIFFRUN_RUSTC)
  set(diffrun_capi_rust ${CMAKE_CURRENT_BINARY_DIR}/test_capi_rust)
  add_custom_command(
    OUTPUT ${diffrun_capi_rust}
    COMMAND ${DIFFRUN_RUSTC} --edition 2021 -O --crate-name test_capi_rust
            -L native=$<TARGET_FILE_DIR:diffrun_dump_writer>
            -C link-arg=-Wl,-rpath,$<TARGET_FILE_DIR:diffrun_dump_writer>
            -o ${diffrun_capi_rust} ${CMAKE_CURRENT_SOURCE_DIR}/capi/test_capi_rust.rs
    DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/capi/test_capi_rust.rs diffrun_dump_writer
    COMMENT "Building the Rust C API test with ${DIFFRUN_RUSTC}")
  add_custom_target(capi_rust_program ALL DEPENDS ${diffrun_capi_rust})
else()
  message(STATUS "rustc not found: the Rust C API test skips")
endif()

add_test(NAME test_capi
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_capi.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_capi PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python;DIFFRUN_CAPI_C=$<TARGET_FILE:test_capi_c>;DIFFRUN_CAPI_CPP=$<TARGET_FILE:test_capi_cpp>;DIFFRUN_CAPI_RUST=${diffrun_capi_rust};DIFFRUN_CAPI_LIB=$<TARGET_FILE:diffrun_dump_writer>;DIFFRUN_CC=${CMAKE_C_COMPILER}")

add_test(NAME test_capi_install
         COMMAND bash tests/capi/install_test.sh ${CMAKE_BINARY_DIR} $<TARGET_FILE:diffrun>
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_capi_install PROPERTIES LABELS cpu SKIP_RETURN_CODE 77 TIMEOUT 300)
if(DIFFRUN_SANITIZE)
  set_tests_properties(test_capi_install PROPERTIES ENVIRONMENT "DIFFRUN_SANITIZE_FLAGS=-fsanitize=address,undefined")
  set_property(TEST test_capi APPEND PROPERTY ENVIRONMENT "DIFFRUN_SANITIZE_FLAGS=-fsanitize=address,undefined")
endif()

# Device puts where no GPU is needed: the host put's checks, and a clear error without CUDA (tests/capi/test_capi_device.c).
add_executable(test_capi_device capi/test_capi_device.c)
set_target_properties(test_capi_device PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
target_compile_options(test_capi_device PRIVATE -Wall -Wextra -pedantic)
target_link_libraries(test_capi_device PRIVATE diffrun::dump_writer)
add_test(NAME test_capi_device COMMAND test_capi_device ${CMAKE_CURRENT_BINARY_DIR}/test_capi_device.h5)
set_tests_properties(test_capi_device PROPERTIES LABELS cpu TIMEOUT 60)

# The reader and diffrun_dump_put_rows from C (tests/capi/test_capi_reader.c): a cache cut to the rows each step
# wrote is read back whole; errors name the file, step and dataset. test_capi reads the same dump with diffrun
# validate and the Python package.
add_executable(test_capi_reader capi/test_capi_reader.c)
set_target_properties(test_capi_reader PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
target_compile_options(test_capi_reader PRIVATE -Wall -Wextra -pedantic)
target_link_libraries(test_capi_reader PRIVATE diffrun::dump_writer)
add_test(NAME test_capi_reader
         COMMAND test_capi_reader ${CMAKE_CURRENT_BINARY_DIR}/test_capi_reader.h5 ${PROJECT_SOURCE_DIR}/README.md)
set_tests_properties(test_capi_reader PROPERTIES LABELS cpu TIMEOUT 60)
set_property(TEST test_capi APPEND PROPERTY ENVIRONMENT "DIFFRUN_CAPI_READER=$<TARGET_FILE:test_capi_reader>")
