/* The C API compiled as C: writes a small synthetic dump through every setter and dtype, then checks each error path returns its code and a message. */
#include <diffrun/dump_writer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* rc == want and the message holds `part` */
#define CHECK_RC(call, want, d, part)                                                                       \
  do {                                                                                                      \
    int rc_ = (call);                                                                                       \
    const char* msg_ = diffrun_dump_last_error(d);                                                          \
    CHECK(rc_ == (want) && strstr(msg_, (part)) != NULL, "%s: rc %d (want %d), message \"%s\" (want \"%s\")", \
          #call, rc_, (want), msg_, (part));                                                                \
  } while (0)

/* A tiny llama: D 8, H 2, Hkv 1, Dh 4, F 12, V 32, one layer. */
enum { D = 8, H = 2, HKV = 1, DH = 4, F = 12, V = 32 };

static void set_meta(diffrun_dump* d) {
  static const int32_t prompt[3] = {3, 5, 7};
  static const int32_t all[4] = {3, 5, 7, 9};
  CHECK_RC(diffrun_dump_set_string(d, "backend", "c-test"), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "precision", "f32"), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "model_path", "tiny.gguf"), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "model_fingerprint", "1234:0123456789abcdef"), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "arch", "llama"), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_layer", 1), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_embd", D), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_head", H), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_head_kv", HKV), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "head_dim", DH), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_ff", F), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_vocab", V), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_ctx", 64), 0, d, "");
  CHECK_RC(diffrun_dump_set_real(d, "rope_theta", 10000.0), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "rope_type", "norm"), 0, d, "");
  CHECK_RC(diffrun_dump_set_real(d, "rms_eps", 1e-5), 0, d, "");
  CHECK_RC(diffrun_dump_set_bool(d, "tied_output", 1), 0, d, "");
  CHECK_RC(diffrun_dump_set_bool(d, "qkv_bias", 0), 0, d, "");
  CHECK_RC(diffrun_dump_set_bool(d, "qk_norm", 0), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "prompt", "three tokens"), 0, d, "");
  CHECK_RC(diffrun_dump_set_ids(d, "token_ids", prompt, 3), 0, d, "");
  CHECK_RC(diffrun_dump_set_ids(d, "all_token_ids", all, 4), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "device", "a C test"), 0, d, ""); /* a backend fact */
}

/* float -> IEEE half bits (values here are small and exact enough), float -> bf16 bits (truncated) */
static uint16_t f16_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = (x >> 13) & 0x3ffu;
  if (exp <= 0) return (uint16_t)sign;
  return (uint16_t)(sign | ((uint32_t)exp << 10) | mant);
}
static uint16_t bf16_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  return (uint16_t)(x >> 16);
}

/* Every checkpoint of a step but tokens. */
static void put_step(diffrun_dump* d, int step, int64_t T, int64_t S) {
  static float f32[4096];
  static double f64[4096];
  static uint16_t h16[4096];
  for (int i = 0; i < 4096; ++i) {
    f32[i] = 0.25f * (float)((i * 7 + step) % 23) - 2.0f;
    f64[i] = f32[i];
    h16[i] = f16_bits(f32[i]);
  }
  int64_t td[2] = {T, D}, tf[2] = {T, F}, thd[3] = {T, H, DH}, tkv[3] = {T, HKV, DH}, skv[3] = {S, HKV, DH};
  int64_t merged[2] = {T, H * DH}, hts[3] = {H, T, S}, tv[2] = {T, V}, htd[3] = {H, T, DH};
  CHECK_RC(diffrun_dump_put(d, "embd", -1, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "attn_norm-0", 0, td, 2, DIFFRUN_F16, h16), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "Qcur-0", 0, merged, 2, DIFFRUN_F32, f32), 0, d, ""); /* [T, H*Dh] */
  CHECK_RC(diffrun_dump_put(d, "Kcur-0", 0, tkv, 3, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "Vcur-0", 0, tkv, 3, DIFFRUN_F64, f64), 0, d, "");
  CHECK_RC(diffrun_dump_put_ex(d, "Qrope-0", 0, htd, 3, DIFFRUN_F32, f32, "H,T,Dh", "f16"), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "Krope-0", 0, tkv, 3, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "cache_k-0", 0, skv, 3, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "cache_v-0", 0, skv, 3, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "kq_soft_max-0", 0, hts, 3, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "kqv_out-0", 0, thd, 3, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "attn_out-0", 0, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "ffn_inp-0", 0, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "ffn_norm-0", 0, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "ffn_gate-0", 0, tf, 2, DIFFRUN_F64, f64), 0, d, "");
  {
    uint16_t b[4096];
    for (int i = 0; i < 4096; ++i) b[i] = bf16_bits(f32[i]);
    CHECK_RC(diffrun_dump_put(d, "ffn_up-0", 0, tf, 2, DIFFRUN_BF16, b), 0, d, "");
  }
  CHECK_RC(diffrun_dump_put(d, "ffn_swiglu-0", 0, tf, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "ffn_out-0", 0, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "l_out-0", 0, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "result_norm", -1, td, 2, DIFFRUN_F32, f32), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "result_output", -1, tv, 2, DIFFRUN_F32, f32), 0, d, "");
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s OUT.h5 UNWRITABLE_DIR\n", argv[0]);
    return 2;
  }
  const char* out = argv[1];
  diffrun_dump* d = NULL;

  /* Error paths without a handle. */
  char bad_path[4096];
  snprintf(bad_path, sizeof bad_path, "%s/x.h5", argv[2]);
  CHECK_RC(diffrun_dump_open(bad_path, &d), DIFFRUN_DUMP_E_IO, NULL, "cannot create");
  CHECK(d == NULL, "a failed open leaves the handle NULL");
  CHECK_RC(diffrun_dump_open(NULL, &d), DIFFRUN_DUMP_E_ARG, NULL, "path is NULL");
  CHECK_RC(diffrun_dump_step(NULL, 0), DIFFRUN_DUMP_E_ARG, NULL, "NULL");
  CHECK_RC(diffrun_dump_put(NULL, "embd", -1, NULL, 0, DIFFRUN_F32, NULL), DIFFRUN_DUMP_E_ARG, NULL, "handle is NULL");
  CHECK_RC(diffrun_dump_close(NULL), DIFFRUN_DUMP_E_ARG, NULL, "handle is NULL");
  CHECK(strcmp(diffrun_dump_strerror(DIFFRUN_DUMP_E_STEP), "step out of order") == 0, "strerror");

  /* Meta incomplete when step 0 starts: every problem in one message; then abort. */
  CHECK_RC(diffrun_dump_open(out, &d), 0, d, "");
  CHECK_RC(diffrun_dump_set_string(d, "backend", "c-test"), 0, d, "");
  CHECK_RC(diffrun_dump_step(d, 0), DIFFRUN_DUMP_E_META, d, "root attribute 'arch': missing");
  CHECK(strstr(diffrun_dump_last_error(d), "root attribute 'qk_norm': missing") != NULL, "all problems listed: %s",
        diffrun_dump_last_error(d));
  CHECK_RC(diffrun_dump_set_int(d, "arch", 3), DIFFRUN_DUMP_E_META, d, "'arch' is a string");
  CHECK_RC(diffrun_dump_set_string(d, "arch", "mistral"), DIFFRUN_DUMP_E_META, d, "not one of");
  CHECK_RC(diffrun_dump_set_int(d, "format_version", 2), DIFFRUN_DUMP_E_META, d, "written by the library");
  CHECK_RC(diffrun_dump_abort(d), 0, NULL, "");

  /* The real dump. */
  CHECK_RC(diffrun_dump_open(out, &d), 0, d, "");
  set_meta(d);
  int64_t td[2] = {3, D};
  static float zeros[4096];
  CHECK_RC(diffrun_dump_put(d, "embd", -1, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_STEP, d, "no step started");
  {
    const int32_t* fed = NULL;
    size_t n_fed = 0;
    CHECK_RC(diffrun_dump_step_tokens(d, 0, &fed, &n_fed), 0, d, "");
    CHECK(n_fed == 3 && fed[0] == 3 && fed[2] == 7, "step 0 is fed the prompt");
    CHECK_RC(diffrun_dump_step_tokens(d, 1, &fed, &n_fed), 0, d, "");
    CHECK(n_fed == 1 && fed[0] == 9, "step 1 is fed all_token_ids[3]");
    CHECK_RC(diffrun_dump_step_tokens(d, 2, &fed, &n_fed), DIFFRUN_DUMP_E_STEP, d, "covers steps 0..1, not step 2");
    CHECK_RC(diffrun_dump_step_tokens(NULL, 0, &fed, &n_fed), DIFFRUN_DUMP_E_ARG, NULL, "handle is NULL");
  }
  CHECK_RC(diffrun_dump_step(d, 1), DIFFRUN_DUMP_E_STEP, d, "out of order");
  CHECK_RC(diffrun_dump_step(d, 0), 0, d, "");
  CHECK_RC(diffrun_dump_set_int(d, "n_layer", 2), DIFFRUN_DUMP_E_STEP, d, "after step 0 started");
  CHECK_RC(diffrun_dump_put(d, "embd", -1, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_STEP, d, "put \"tokens\" first");
  CHECK_RC(diffrun_dump_put_foreign(d, "Qcur-0#3", td, 2, DIFFRUN_F32, zeros, NULL), DIFFRUN_DUMP_E_STEP, d,
           "put \"tokens\" first");
  const int32_t prompt[3] = {3, 5, 7};
  int64_t three[1] = {3};
  CHECK_RC(diffrun_dump_put(d, "tokens", -1, three, 1, DIFFRUN_F32, prompt), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "tokens are DIFFRUN_I32 ids");
  CHECK_RC(diffrun_dump_put(d, "tokens", -1, three, 1, DIFFRUN_I32, prompt), 0, d, "");
  CHECK_RC(diffrun_dump_put(d, "ffn_down-0", 0, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "not a checkpoint name");
  CHECK_RC(diffrun_dump_put(d, "Qnorm-0", 0, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "does not exist for architecture llama");
  CHECK_RC(diffrun_dump_put(d, "l_out-1", 1, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_CHECKPOINT, d, "outside 0..0");
  CHECK_RC(diffrun_dump_put(d, "attn_out-0", 1, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "the name says layer 0");
  int64_t wrong[2] = {3, D + 1};
  CHECK_RC(diffrun_dump_put(d, "ffn_norm-0", 0, wrong, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "does not fit layout 'T,D' = [3, 8]");
  CHECK_RC(diffrun_dump_put(d, "result_norm", -1, td, 2, 99, zeros), DIFFRUN_DUMP_E_ARG, d,
           "unknown dtype 99");
  CHECK_RC(diffrun_dump_put_ex(d, "ffn_out-0", 0, td, 2, DIFFRUN_F32, zeros, "D,T,X", NULL), DIFFRUN_DUMP_E_CHECKPOINT,
           d, "not a permutation");
  CHECK_RC(diffrun_dump_put(d, "ffn_out-0", 0, td, 2, DIFFRUN_F32, NULL), DIFFRUN_DUMP_E_ARG, d, "data is NULL");
  /* Dimensions whose product overflows 64 bits ({2^32, 2^32} once wrapped to 0 elements and passed
     with data NULL), on every put. */
  int64_t huge[2] = {(int64_t)1 << 32, (int64_t)1 << 32};
  CHECK_RC(diffrun_dump_put(d, "ffn_out-0", 0, huge, 2, DIFFRUN_F32, NULL), DIFFRUN_DUMP_E_ARG, d,
           "shape [4294967296, 4294967296] overflows");
  CHECK_RC(diffrun_dump_put_foreign(d, "norm-0", huge, 2, DIFFRUN_F32, NULL, NULL), DIFFRUN_DUMP_E_ARG, d, "overflows");
  int64_t huge3[3] = {(int64_t)1 << 21, (int64_t)1 << 21, (int64_t)1 << 21};
  CHECK_RC(diffrun_dump_put(d, "ffn_out-0", 0, huge3, 3, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_ARG, d, "overflows");
  CHECK_RC(diffrun_dump_put_foreign(d, "inp_pos", three, 1, DIFFRUN_I32, prompt, NULL), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "DIFFRUN_I32 is for tokens");
  CHECK_RC(diffrun_dump_put_foreign(d, "norm-0", td, 2, DIFFRUN_F32, zeros, "f8"), DIFFRUN_DUMP_E_ARG, d,
           "native_dtype \"f8\"");
  put_step(d, 0, 3, 3);
  CHECK_RC(diffrun_dump_put(d, "embd", -1, td, 2, DIFFRUN_F32, zeros), DIFFRUN_DUMP_E_CHECKPOINT, d, "recorded twice");
  CHECK_RC(diffrun_dump_step(d, 3), DIFFRUN_DUMP_E_STEP, d, "the next is 1");
  CHECK_RC(diffrun_dump_step(d, 1), 0, d, "");
  const int32_t wrong_id[1] = {11};
  int64_t one[1] = {1};
  CHECK_RC(diffrun_dump_put(d, "tokens", -1, one, 1, DIFFRUN_I32, wrong_id), DIFFRUN_DUMP_E_CHECKPOINT, d,
           "all_token_ids feeds 9");
  const int32_t next[1] = {9};
  CHECK_RC(diffrun_dump_put(d, "tokens", -1, one, 1, DIFFRUN_I32, next), 0, d, "");
  put_step(d, 1, 1, 4);
  const int32_t argmax[2] = {9, 4};
  CHECK_RC(diffrun_dump_set_ids(d, "argmax", argmax, 2), 0, d, ""); /* known at the end: allowed after the steps */
  CHECK_RC(diffrun_dump_close(d), 0, NULL, "");

  printf("test_capi_c: %d checks, %d failed\n", n_checks, n_failed);
  return n_failed == 0 ? 0 : 1;
}
