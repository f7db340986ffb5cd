/* The C API's device puts where no GPU is needed: argument errors come from the host put's own checks, and a
 * device put without CUDA (no driver, no device, no context) or with a pointer CUDA does not know fails with a
 * message and leaves the dump usable. Run with the dump's path; exit 0 when every check passed. */
#include <diffrun/dump_writer.h>

#include <stdio.h>
#include <string.h>

#include "check.h"

#define CHECK_RC(call, want, part)                                                                            \
  do {                                                                                                        \
    int rc_ = (call);                                                                                         \
    const char* msg_ = diffrun_dump_last_error(d);                                                            \
    CHECK(rc_ == (want) && strstr(msg_, (part)) != NULL, "%s: rc %d (want %d), message \"%s\" (want \"%s\")", \
          #call, rc_, (want), msg_, (part));                                                                  \
  } while (0)

enum { D = 8, H = 2, HKV = 1, DH = 4, F = 12, V = 32 };

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: test_capi_device OUT.h5\n");
    return 2;
  }
  static const int32_t prompt[2] = {3, 5};
  static float host[2 * F];
  diffrun_dump* d = NULL;
  if (diffrun_dump_open(argv[1], &d) != DIFFRUN_DUMP_OK) {
    fprintf(stderr, "open: %s\n", diffrun_dump_last_error(NULL));
    return 1;
  }
  diffrun_dump_set_string(d, "backend", "c-device-test");
  diffrun_dump_set_string(d, "precision", "f32");
  diffrun_dump_set_string(d, "model_path", "tiny.gguf");
  diffrun_dump_set_string(d, "model_fingerprint", "1234:0123456789abcdef");
  diffrun_dump_set_string(d, "arch", "llama");
  diffrun_dump_set_int(d, "n_layer", 1);
  diffrun_dump_set_int(d, "n_embd", D);
  diffrun_dump_set_int(d, "n_head", H);
  diffrun_dump_set_int(d, "n_head_kv", HKV);
  diffrun_dump_set_int(d, "head_dim", DH);
  diffrun_dump_set_int(d, "n_ff", F);
  diffrun_dump_set_int(d, "n_vocab", V);
  diffrun_dump_set_int(d, "n_ctx", 64);
  diffrun_dump_set_real(d, "rope_theta", 10000.0);
  diffrun_dump_set_string(d, "rope_type", "norm");
  diffrun_dump_set_real(d, "rms_eps", 1e-5);
  diffrun_dump_set_bool(d, "tied_output", 1);
  diffrun_dump_set_bool(d, "qkv_bias", 0);
  diffrun_dump_set_bool(d, "qk_norm", 0);
  diffrun_dump_set_string(d, "prompt", "two tokens");
  diffrun_dump_set_ids(d, "token_ids", prompt, 2);

  const int64_t td[2] = {2, D}, tf[2] = {2, F}, wrong[2] = {2, D + 1}, two[1] = {2};
  CHECK_RC(diffrun_dump_put_device(d, "embd", -1, td, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_STEP, "no step started");
  CHECK_RC(diffrun_dump_step(d, 0), DIFFRUN_DUMP_OK, "");
  CHECK_RC(diffrun_dump_put_device(d, "embd", -1, td, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_STEP,
           "put \"tokens\" first");
  CHECK_RC(diffrun_dump_put_device(d, "tokens", -1, two, 1, DIFFRUN_I32, prompt, NULL), DIFFRUN_DUMP_E_ARG,
           "tokens are host ids");
  CHECK_RC(diffrun_dump_put(d, "tokens", -1, two, 1, DIFFRUN_I32, prompt), DIFFRUN_DUMP_OK, "");
  /* The host put's checks, before CUDA is asked anything. */
  CHECK_RC(diffrun_dump_put_device(d, "embd", -1, td, 2, DIFFRUN_F32, NULL, NULL), DIFFRUN_DUMP_E_ARG, "data is NULL");
  CHECK_RC(diffrun_dump_put_device(d, "embd", -1, wrong, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_CHECKPOINT,
           "embd");
  CHECK_RC(diffrun_dump_put_device(d, "embd", -1, td, 2, 99, host, NULL), DIFFRUN_DUMP_E_ARG, "unknown dtype 99");
  CHECK_RC(diffrun_dump_put_device(d, "ffn_down-0", 0, td, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_CHECKPOINT,
           "ffn_down-0");
  CHECK_RC(diffrun_dump_put_device(d, NULL, -1, td, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_ARG, "NULL");
  CHECK_RC(diffrun_dump_put_device(NULL, "embd", -1, td, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_ARG, "");
  CHECK_RC(diffrun_dump_capture_end(d, NULL), DIFFRUN_DUMP_E_ARG, "graph is NULL");

  /* A valid put of host (pageable) memory: without CUDA, E_CUDA naming why; with a driver and a device,
   * no context in this thread (E_CUDA) or a pointer CUDA does not know (E_ARG). Never a crash. */
  {
    const int rc = diffrun_dump_put_device(d, "ffn_gate-0", 0, tf, 2, DIFFRUN_F32, host, NULL);
    const char* msg = diffrun_dump_last_error(d);
    CHECK((rc == DIFFRUN_DUMP_E_CUDA && strstr(msg, "CUDA") != NULL) ||
              (rc == DIFFRUN_DUMP_E_ARG && strstr(msg, "is not memory CUDA knows") != NULL),
          "device put of host memory: rc %d, message \"%s\"", rc, msg);
    CHECK(strstr(msg, "step_0000/ffn_gate-0") != NULL || strstr(msg, "CUDA") != NULL, "message names it: \"%s\"", msg);
    printf("device put without a usable device: rc %d (%s): %s\n", rc, diffrun_dump_strerror(rc), msg);
  }
  {
    const int rc = diffrun_dump_set_staging(d, 1 << 20);
    CHECK(rc == DIFFRUN_DUMP_E_CUDA && strlen(diffrun_dump_last_error(d)) > 0, "set_staging: rc %d, \"%s\"", rc,
          diffrun_dump_last_error(d));
  }
  {
    const int rc = diffrun_dump_replay(d, 0, NULL);
    CHECK(rc == DIFFRUN_DUMP_E_ARG && strstr(diffrun_dump_last_error(d), "not a graph") != NULL,
          "replay of an unknown graph: rc %d, \"%s\"", rc, diffrun_dump_last_error(d));
  }
  /* Deferred puts: the same checks first, the same clear error without CUDA; a flush with nothing noted
   * does nothing. */
  CHECK_RC(diffrun_dump_put_device_deferred(d, "embd", -1, wrong, 2, DIFFRUN_F32, host, NULL),
           DIFFRUN_DUMP_E_CHECKPOINT, "embd");
  CHECK_RC(diffrun_dump_put_device_deferred(NULL, "embd", -1, td, 2, DIFFRUN_F32, host, NULL), DIFFRUN_DUMP_E_ARG, "");
  {
    const int rc = diffrun_dump_put_device_deferred(d, "ffn_gate-0", 0, tf, 2, DIFFRUN_F32, host, NULL);
    const char* msg = diffrun_dump_last_error(d);
    CHECK((rc == DIFFRUN_DUMP_E_CUDA && strstr(msg, "CUDA") != NULL) ||
              (rc == DIFFRUN_DUMP_E_ARG && strstr(msg, "is not memory CUDA knows") != NULL),
          "deferred device put of host memory: rc %d, message \"%s\"", rc, msg);
  }
  CHECK_RC(diffrun_dump_flush_device(d, NULL), DIFFRUN_DUMP_OK, "");
  CHECK_RC(diffrun_dump_flush_device(NULL, NULL), DIFFRUN_DUMP_E_ARG, "");
  CHECK_RC(diffrun_dump_flush(d), DIFFRUN_DUMP_OK, "");
  CHECK(strcmp(diffrun_dump_strerror(DIFFRUN_DUMP_E_CUDA), "CUDA unavailable or failed") == 0, "strerror");

  /* The failures recorded nothing: the same names still go in from the host. */
  CHECK_RC(diffrun_dump_put(d, "embd", -1, td, 2, DIFFRUN_F32, host), DIFFRUN_DUMP_OK, "");
  CHECK_RC(diffrun_dump_put(d, "ffn_gate-0", 0, tf, 2, DIFFRUN_F32, host), DIFFRUN_DUMP_OK, "");
  if (diffrun_dump_close(d) != DIFFRUN_DUMP_OK) {
    ++n_failed;
    fprintf(stderr, "close: %s\n", diffrun_dump_last_error(NULL));
  }
  printf("test_capi_device: %d checks, %d failed\n", n_checks, n_failed);
  return n_failed == 0 ? 0 : 1;
}
