# Reliability through the built diffrun: signals (temporaries removed, exit 130/143), pairs from different runs, stale temporaries.
diffrun_test(test_interrupt SOURCES test_interrupt.cpp LIBS diffrun_checkpoints FIXTURES tiny_models TIMEOUT 300)
add_dependencies(test_interrupt diffrun)
