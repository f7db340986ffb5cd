/* A one-file consumer of the installed C API: writes a one-step dump of a tiny llama config (embd only), then reads it back with the reader. */
#include <diffrun/dump_writer.h>

#include <stdio.h>

#define TRY(call)                                                                  \
  do {                                                                             \
    if ((call) != DIFFRUN_DUMP_OK) {                                               \
      fprintf(stderr, "%s: %s\n", #call, diffrun_dump_last_error(d));              \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  diffrun_dump* d = NULL;
  const int32_t ids[2] = {1, 2};
  float embd[2 * 8];
  for (int i = 0; i < 16; ++i) embd[i] = (float)i;
  if (diffrun_dump_open(argv[1], &d) != DIFFRUN_DUMP_OK) {
    fprintf(stderr, "open: %s\n", diffrun_dump_last_error(NULL));
    return 1;
  }
  TRY(diffrun_dump_set_string(d, "backend", "consumer"));
  TRY(diffrun_dump_set_string(d, "precision", "f32"));
  TRY(diffrun_dump_set_string(d, "model_path", "none.gguf"));
  TRY(diffrun_dump_set_string(d, "model_fingerprint", "0:0000000000000000"));
  TRY(diffrun_dump_set_string(d, "arch", "llama"));
  TRY(diffrun_dump_set_int(d, "n_layer", 1));
  TRY(diffrun_dump_set_int(d, "n_embd", 8));
  TRY(diffrun_dump_set_int(d, "n_head", 2));
  TRY(diffrun_dump_set_int(d, "n_head_kv", 2));
  TRY(diffrun_dump_set_int(d, "head_dim", 4));
  TRY(diffrun_dump_set_int(d, "n_ff", 16));
  TRY(diffrun_dump_set_int(d, "n_vocab", 10));
  TRY(diffrun_dump_set_int(d, "n_ctx", 32));
  TRY(diffrun_dump_set_real(d, "rope_theta", 10000.0));
  TRY(diffrun_dump_set_string(d, "rope_type", "norm"));
  TRY(diffrun_dump_set_real(d, "rms_eps", 1e-5));
  TRY(diffrun_dump_set_bool(d, "tied_output", 0));
  TRY(diffrun_dump_set_bool(d, "qkv_bias", 0));
  TRY(diffrun_dump_set_bool(d, "qk_norm", 0));
  TRY(diffrun_dump_set_string(d, "prompt", "1,2"));
  TRY(diffrun_dump_set_ids(d, "token_ids", ids, 2));
  TRY(diffrun_dump_step(d, 0));
  const int64_t t[1] = {2}, td[2] = {2, 8};
  TRY(diffrun_dump_put(d, "tokens", -1, t, 1, DIFFRUN_I32, ids));
  TRY(diffrun_dump_put(d, "embd", -1, td, 2, DIFFRUN_F32, embd));
  if (diffrun_dump_close(d) != DIFFRUN_DUMP_OK) {
    fprintf(stderr, "close: %s\n", diffrun_dump_last_error(NULL));
    return 1;
  }
  diffrun_dump_reader* r = NULL;
  const float* x = NULL;
  const int64_t* dims = NULL;
  const int32_t* got = NULL;
  size_t n = 0;
  int ndim = 0;
  int64_t row_offset = -1;
  if (diffrun_dump_reader_open(argv[1], &r) != DIFFRUN_DUMP_OK ||
      diffrun_dump_reader_tokens(r, 0, &got, &n) != DIFFRUN_DUMP_OK ||
      diffrun_dump_reader_get(r, "embd", 0, &x, &dims, &ndim, &row_offset) != DIFFRUN_DUMP_OK) {
    fprintf(stderr, "read: %s\n", diffrun_dump_reader_last_error(r));
    diffrun_dump_reader_close(r);
    return 1;
  }
  int ok = n == 2 && got[0] == 1 && got[1] == 2 && ndim == 2 && dims[0] == 2 && dims[1] == 8 && row_offset == 0;
  for (int i = 0; ok && i < 16; ++i) ok = x[i] == embd[i];
  diffrun_dump_reader_close(r);
  if (!ok) {
    fprintf(stderr, "read: %s holds other tokens or embd than were written\n", argv[1]);
    return 1;
  }
  printf("consumer: wrote and read back %s with diffrun-dump-writer %s\n", argv[1], diffrun_dump_version());
  return 0;
}
