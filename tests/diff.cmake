# diff/: metrics, tolerance rules, comparator and reports; `diffrun compare` and `diffrun --prompt` end to end.
diffrun_test(test_metrics SOURCES test_metrics.cpp LIBS diffrun_diff)
diffrun_test(test_tolerances SOURCES test_tolerances.cpp LIBS diffrun_diff)
diffrun_test(test_compare SOURCES test_compare.cpp LIBS diffrun_diff)
# Runs the built diffrun ($DIFFRUN_BIN) on synthetic dumps and on a tiny fixture model.
diffrun_test(test_cli SOURCES test_cli.cpp LIBS diffrun_checkpoints FIXTURES tiny_models TIMEOUT 600)
add_dependencies(test_cli diffrun)
