# Tests of the tokenizer and chat templates (model/tokenizer*, model/chat_template.cpp).
diffrun_test(test_tokenizer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer.cpp
             LIBS diffrun_model nlohmann_json::nlohmann_json FIXTURES "tiny_models;smollm2")
diffrun_test(test_tokenizer_roundtrip SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer_roundtrip.cpp
             LIBS diffrun_model FIXTURES "tiny_models;smollm2" TIMEOUT 120)
diffrun_test(test_chat_template SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_chat_template.cpp
             LIBS diffrun_model FIXTURES "tiny_models;smollm2")
