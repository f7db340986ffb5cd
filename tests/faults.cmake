# Fault injection and isolation replay: the CPU reference with every catalog fault (label cpu), and
# the CUDA engine with the same faults plus the sensitivity figures (label gpu).
diffrun_test(test_faults SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_faults.cpp
             LIBS diffrun_reference diffrun_diff FIXTURES tiny_models TIMEOUT 600)
add_dependencies(test_faults diffrun)
# One OpenMP thread: the tiny models gain nothing from more, and spinning threads on shared CI cores
# cost several times the run.
set_property(TEST test_faults APPEND PROPERTY ENVIRONMENT OMP_NUM_THREADS=1)
if(DIFFRUN_HAVE_CUDA)
  # DIFFRUN_SMOLLM2_SLICE (an optional model path) passes through ctest's environment.
  diffrun_test(test_engine_faults GPU SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_faults.cpp
               LIBS diffrun_engine diffrun_reference diffrun_diff FIXTURES tiny_models TIMEOUT 1800)
endif()
