# model/: GGUF reader, dequantization and ModelConfig tests.
diffrun_test(test_dequant SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_dequant.cpp
             LIBS diffrun_model nlohmann_json::nlohmann_json)
diffrun_test(test_gguf SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gguf.cpp
             LIBS diffrun_model nlohmann_json::nlohmann_json FIXTURES tiny_models smollm2 TIMEOUT 600)
diffrun_test(test_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_config.cpp
             LIBS diffrun_model FIXTURES tiny_models smollm2)
diffrun_test(test_tensor_table SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tensor_table.cpp LIBS diffrun_model)
