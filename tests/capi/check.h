/* The C API tests' check counter: CHECK(cond, printf-style message) counts a check and reports a failure
 * with its line; each test prints n_checks and n_failed at its end. */
#ifndef DIFFRUN_TESTS_CAPI_CHECK_H
#define DIFFRUN_TESTS_CAPI_CHECK_H

#include <stdio.h>

static int n_checks = 0, n_failed = 0;

#define CHECK(cond, ...)                           \
  do {                                             \
    ++n_checks;                                    \
    if (!(cond)) {                                 \
      ++n_failed;                                  \
      fprintf(stderr, "FAIL line %d: ", __LINE__); \
      fprintf(stderr, __VA_ARGS__);                \
      fprintf(stderr, "\n");                       \
    }                                              \
  } while (0)

#endif
