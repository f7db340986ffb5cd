# The Python package (python/): writer, fingerprint and validator against the C++ side, the dump schema against the docs, the example outside engine, and (label torch) the PyTorch hooks and transformers adapter.
add_test(NAME test_python_package
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider python/tests/test_writer.py python/tests/test_readme.py
                 python/tests/test_validate.py python/tests/test_schema.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_python_package PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED "tiny_models;smollm2"
  TIMEOUT 300 ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python")

# examples/numpy_engine: an outside engine through the public Python API; clean, then each seeded bug.
add_test(NAME example_numpy_engine
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider examples/numpy_engine/test_numpy_engine.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(example_numpy_engine PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python;OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")

# examples/tp_numpy_engine: the numpy engine as 2 and 4 tensor-parallel ranks, one rank dump each; clean, then each
# seeded shard bug at its checkpoint, step and rank.
add_test(NAME example_tp_numpy_engine
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider examples/tp_numpy_engine/test_tp_numpy_engine.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(example_tp_numpy_engine PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python;OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")

# diffrun.torch and diffrun.adapters.transformers (label torch): skips (exit 77) without torch/transformers/gguf.
add_test(NAME test_python_torch
         COMMAND ${Python3_EXECUTABLE} python/tests/run_torch_tests.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_python_torch PROPERTIES LABELS "torch;python" FIXTURES_REQUIRED "tiny_models" TIMEOUT 900
  SKIP_RETURN_CODE 77 ENVIRONMENT "${DIFFRUN_TEST_ENV}"
  ENVIRONMENT_MODIFICATION "PYTHONPATH=path_list_prepend:${PROJECT_SOURCE_DIR}/python")  # keeps a PYTHONPATH that holds torch

# The mixtures of experts against transformers (label torch): the CPU reference of tiny-qwen3moe, tiny-qwen2moe and
# tiny-mixtral at every checkpoint transformers exposes, the hf name map on their modules; skips (exit 77) likewise.
add_test(NAME test_transformers_moe
         COMMAND ${Python3_EXECUTABLE} python/tests/run_torch_tests.py python/tests/test_transformers_moe.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_transformers_moe PROPERTIES LABELS "torch;python" FIXTURES_REQUIRED "tiny_models" TIMEOUT 900
  SKIP_RETURN_CODE 77 ENVIRONMENT "${DIFFRUN_TEST_ENV}"
  ENVIRONMENT_MODIFICATION "PYTHONPATH=path_list_prepend:${PROJECT_SOURCE_DIR}/python")

# diffrun.writer with torch CUDA tensors, graph capture included (label gpu): skips (exit 77) without torch or a device.
add_test(NAME test_python_cuda_writer
         COMMAND ${Python3_EXECUTABLE} python/tests/test_writer_cuda.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_python_cuda_writer PROPERTIES LABELS "gpu;python" TIMEOUT 300 SKIP_RETURN_CODE 77
  ENVIRONMENT "${DIFFRUN_TEST_ENV}"
  ENVIRONMENT_MODIFICATION "PYTHONPATH=path_list_prepend:${PROJECT_SOURCE_DIR}/python")

# The tensor-parallel fault catalog through the CLI (label gpu): exits 77 (skipped) on a host of fewer than 2 GPUs.
add_test(NAME test_engine_tp_faults COMMAND ${Python3_EXECUTABLE} tests/test_engine_tp_faults.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_engine_tp_faults PROPERTIES LABELS "gpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  SKIP_RETURN_CODE 77 ENVIRONMENT "${DIFFRUN_TEST_ENV}")
