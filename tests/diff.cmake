# diff/: metrics, tolerance rules, comparator and reports; `diffrun compare` and `diffrun --prompt` end to end.
diffrun_test(test_metrics SOURCES test_metrics.cpp LIBS diffrun_diff)
diffrun_test(test_tolerances SOURCES test_tolerances.cpp LIBS diffrun_diff)
diffrun_test(test_compare SOURCES test_compare.cpp LIBS diffrun_diff)
