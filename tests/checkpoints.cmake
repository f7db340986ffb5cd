# checkpoints/: the vocabulary, the embedded dump schema and the name maps.
diffrun_test(test_vocabulary SOURCES test_vocabulary.cpp LIBS diffrun_checkpoints)
# The embedded dump schema against the facts C++ spells itself (architectures, dtype names, table columns).
diffrun_test(test_dump_schema SOURCES test_dump_schema.cpp LIBS diffrun_dump)
diffrun_test(test_name_map SOURCES test_name_map.cpp LIBS diffrun_checkpoints)
# The Megatron tensor-parallel layout (checkpoints/tensor_parallel).
diffrun_test(test_tensor_parallel SOURCES test_tensor_parallel.cpp LIBS diffrun_checkpoints)
# A pass over several one-token steps split back into the steps (checkpoints/step_batch, the references' draft).
diffrun_test(test_step_batch SOURCES test_step_batch.cpp LIBS diffrun_checkpoints)
