# Reliability through the built diffrun: signals (temporaries removed, exit 130/143), pairs from different runs, stale temporaries, bad input (exit 2, one clear line), the reports of a failed run.
diffrun_test(test_interrupt SOURCES test_interrupt.cpp LIBS diffrun_checkpoints FIXTURES tiny_models TIMEOUT 300)
add_dependencies(test_interrupt diffrun)
# Bad paths and values, the reports of a failed run, odd bytes in prompts and GGUF strings, integer checkpoints.
diffrun_test(test_reliability SOURCES test_reliability.cpp LIBS diffrun_checkpoints FIXTURES tiny_models TIMEOUT 300)
add_dependencies(test_reliability diffrun)
