/* The C API's reader and diffrun_dump_put_rows, compiled as C: writes a three-step dump whose cache holds only the
 * rows each step wrote (row_offset) and whose kq_soft_max and result_output hold their last rows, reads it back
 * (the cache put back together into [S, Hkv, Dh]), then checks each error path returns its code and a message
 * naming the file, step and dataset.
 * Usage: test_capi_reader OUT.h5 NOT_A_DUMP_FILE (an existing file that is not HDF5) */
#include <diffrun/dump_writer.h>

#include <stdio.h>
#include <string.h>

#include "check.h"

/* rc == want and the message holds `part` (and `part2`) */
#define CHECK_RC(call, want, msg_fn, h, part, part2)                                                          \
  do {                                                                                                        \
    int rc_ = (call);                                                                                         \
    const char* msg_ = msg_fn(h);                                                                             \
    CHECK(rc_ == (want) && strstr(msg_, (part)) != NULL && strstr(msg_, (part2)) != NULL,                     \
          "%s: rc %d (want %d), message \"%s\" (want \"%s\" and \"%s\")", #call, rc_, (want), msg_, (part), \
          (part2));                                                                                           \
  } while (0)
#define CHECK_W(call, want, d, part) CHECK_RC(call, want, diffrun_dump_last_error, d, part, "")
#define CHECK_R(call, want, r, part, part2) CHECK_RC(call, want, diffrun_dump_reader_last_error, r, part, part2)

/* A tiny llama: D 8, H 2, Hkv 2, Dh 4, V 10, one layer. Prompt 3 tokens, then two decode steps. */
enum { D = 8, H = 2, HKV = 2, DH = 4, V = 10, T0 = 3, STEPS = 3, S_MAX = T0 + STEPS - 1 };

/* The value of cache row `row` (a position), head h, channel c: the same whichever step wrote it. */
static float cache_value(int row, int h, int c) { return (float)(100 * row + 10 * h + c); }

static void set_meta(diffrun_dump* d) {
  static const int32_t prompt[T0] = {1, 2, 3};
  static const int32_t all[S_MAX] = {1, 2, 3, 4, 5};
  CHECK_W(diffrun_dump_set_string(d, "backend", "c-reader-test"), 0, d, "");
  CHECK_W(diffrun_dump_set_string(d, "precision", "f32"), 0, d, "");
  CHECK_W(diffrun_dump_set_string(d, "model_path", "tiny.gguf"), 0, d, "");
  CHECK_W(diffrun_dump_set_string(d, "model_fingerprint", "1234:0123456789abcdef"), 0, d, "");
  CHECK_W(diffrun_dump_set_string(d, "arch", "llama"), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_layer", 1), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_embd", D), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_head", H), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_head_kv", HKV), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "head_dim", DH), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_ff", 12), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_vocab", V), 0, d, "");
  CHECK_W(diffrun_dump_set_int(d, "n_ctx", 32), 0, d, "");
  CHECK_W(diffrun_dump_set_real(d, "rope_theta", 10000.0), 0, d, "");
  CHECK_W(diffrun_dump_set_string(d, "rope_type", "norm"), 0, d, "");
  CHECK_W(diffrun_dump_set_real(d, "rms_eps", 1e-5), 0, d, "");
  CHECK_W(diffrun_dump_set_bool(d, "tied_output", 0), 0, d, "");
  CHECK_W(diffrun_dump_set_bool(d, "qkv_bias", 0), 0, d, "");
  CHECK_W(diffrun_dump_set_bool(d, "qk_norm", 0), 0, d, "");
  CHECK_W(diffrun_dump_set_string(d, "prompt", "1,2,3"), 0, d, "");
  CHECK_W(diffrun_dump_set_ids(d, "token_ids", prompt, T0), 0, d, "");
  CHECK_W(diffrun_dump_set_ids(d, "all_token_ids", all, S_MAX), 0, d, "");
}

static int write_dump(const char* path) {
  static const int32_t prompt[T0] = {1, 2, 3};
  diffrun_dump* d = NULL;
  if (diffrun_dump_open(path, &d) != DIFFRUN_DUMP_OK) {
    fprintf(stderr, "open: %s\n", diffrun_dump_last_error(NULL));
    return 1;
  }
  set_meta(d);
  float cache[T0 * HKV * DH], soft[H * 2 * T0], logits[V];
  for (int step = 0; step < STEPS; ++step) {
    const int t = step == 0 ? T0 : 1, s = T0 + step; /* tokens of the step, cache rows after it */
    const int32_t id = (int32_t)(T0 + step);          /* all_token_ids[T0 + step - 1] */
    const int64_t td[1] = {t};
    CHECK_W(diffrun_dump_step(d, step), 0, d, "");
    CHECK_W(diffrun_dump_put(d, "tokens", -1, td, 1, DIFFRUN_I32, step == 0 ? prompt : &id), 0, d, "");
    /* The cache: the rows this step wrote, s - t .. s - 1 (the prefill's start at 0: a plain put). */
    for (int r = 0; r < t; ++r)
      for (int h = 0; h < HKV; ++h)
        for (int c = 0; c < DH; ++c) cache[(r * HKV + h) * DH + c] = cache_value(s - t + r, h, c);
    const int64_t cd[3] = {t, HKV, DH};
    if (step == 0)
      CHECK_W(diffrun_dump_put(d, "cache_k-0", 0, cd, 3, DIFFRUN_F32, cache), 0, d, "");
    else
      CHECK_W(diffrun_dump_put_rows(d, "cache_k-0", 0, cd, 3, DIFFRUN_F32, cache, s - t), 0, d, "");
    /* cache_v only from step 1 on: no step holds rows 0..2, so it stays the rows it holds. */
    if (step == 1) CHECK_W(diffrun_dump_put_rows(d, "cache_v-0", 0, cd, 3, DIFFRUN_F32, cache, s - t), 0, d, "");
    if (step == 0) {
      /* kq_soft_max: the last 2 query rows of 3, [H, 2, S]; result_output: the last row, [1, V]. */
      const int64_t kd[3] = {H, 2, s}, ld[2] = {1, V};
      for (int i = 0; i < H * 2 * s; ++i) soft[i] = 0.5f * (float)i;
      for (int i = 0; i < V; ++i) logits[i] = (float)i - 4.0f;
      CHECK_W(diffrun_dump_put_rows(d, "kq_soft_max-0", 0, kd, 3, DIFFRUN_F32, soft, 1), 0, d, "");
      CHECK_W(diffrun_dump_put_rows(d, "result_output", -1, ld, 2, DIFFRUN_F32, logits, 2), 0, d, "");
      /* Bad row offsets: named, refused, nothing recorded. */
      const int64_t ed[2] = {2, D};
      CHECK_W(diffrun_dump_put_rows(d, "embd", -1, ed, 2, DIFFRUN_F32, soft, 3), DIFFRUN_DUMP_E_CHECKPOINT, d,
              "row_offset 3 outside the step's 3 token rows");
      CHECK_W(diffrun_dump_put_rows(d, "embd", -1, ed, 2, DIFFRUN_F32, soft, -1), DIFFRUN_DUMP_E_CHECKPOINT, d,
              "step_0000/embd': row_offset -1");
      CHECK_W(diffrun_dump_put_rows(d, "embd", -1, ed, 2, DIFFRUN_F32, soft, 2), DIFFRUN_DUMP_E_CHECKPOINT, d,
              "with row_offset 2");
      CHECK_W(diffrun_dump_put_rows(d, "tokens", -1, td, 1, DIFFRUN_I32, prompt, 1), DIFFRUN_DUMP_E_CHECKPOINT, d,
              "tokens hold every row");
      CHECK_W(diffrun_dump_put_rows(d, "cache_v-0", 0, cd, 3, DIFFRUN_F32, cache, 5), DIFFRUN_DUMP_E_CHECKPOINT, d,
              "3 cache rows (S)");
      CHECK_W(diffrun_dump_put_rows(NULL, "embd", -1, ed, 2, DIFFRUN_F32, soft, 1), DIFFRUN_DUMP_E_ARG, NULL,
              "handle is NULL");
    }
  }
  if (diffrun_dump_close(d) != DIFFRUN_DUMP_OK) {
    fprintf(stderr, "close: %s\n", diffrun_dump_last_error(NULL));
    return 1;
  }
  return 0;
}

static void read_dump(const char* path, const char* not_a_dump) {
  diffrun_dump_reader* r = NULL;
  const float* x = NULL;
  const int64_t* dims = NULL;
  const int32_t* ids = NULL;
  const int* steps = NULL;
  size_t n = 0;
  int ndim = 0;
  int64_t row_offset = -1;
  CHECK_R(diffrun_dump_reader_open(path, &r), 0, NULL, "", "");
  if (!r) return;
  {
    /* A writer copies the meta of the reference this reader holds open (the isolation replay's start). */
    char copy_path[4096];
    diffrun_dump* w = NULL;
    snprintf(copy_path, sizeof copy_path, "%s.copy.h5", path);
    CHECK_W(diffrun_dump_open(copy_path, &w), 0, NULL, "");
    if (w) {
      CHECK_W(diffrun_dump_copy_meta(w, path), 0, w, "");
      diffrun_dump_abort(w);
    }
  }
  CHECK_R(diffrun_dump_reader_steps(r, &steps, &n), 0, r, "", "");
  CHECK(n == STEPS && steps[0] == 0 && steps[2] == 2, "steps: %zu", n);

  /* Teacher forcing: every step's tokens, then E_STEP past the last. */
  int s = 0;
  for (; diffrun_dump_reader_tokens(r, s, &ids, &n) == DIFFRUN_DUMP_OK; ++s)
    CHECK(n == (s == 0 ? 3u : 1u) && ids[n - 1] == (int32_t)(T0 + s), "step %d: %zu tokens, last %d", s, n, (int)ids[n - 1]);
  CHECK(s == STEPS, "the tokens loop ran %d steps", s);
  CHECK_R(diffrun_dump_reader_tokens(r, STEPS, &ids, &n), DIFFRUN_DUMP_E_STEP, r, "no step 3", "steps 0, 1, 2");

  /* The cache of each step, put back together from the rows the steps wrote: [S, Hkv, Dh], row_offset 0. */
  for (int step = 0; step < STEPS; ++step) {
    const int rows = T0 + step;
    CHECK_R(diffrun_dump_reader_get(r, "cache_k-0", step, &x, &dims, &ndim, &row_offset), 0, r, "", "");
    if (!x) continue;
    CHECK(ndim == 3 && dims[0] == rows && dims[1] == HKV && dims[2] == DH && row_offset == 0,
          "step %d cache_k-0: ndim %d, [%lld, ...], row_offset %lld", step, ndim, (long long)dims[0], (long long)row_offset);
    int same = 1;
    for (int i = 0; i < rows && same; ++i)
      for (int h = 0; h < HKV; ++h)
        for (int c = 0; c < DH; ++c) same = same && x[(i * HKV + h) * DH + c] == cache_value(i, h, c);
    CHECK(same, "step %d cache_k-0: the rows put back together differ from those written", step);
  }
  /* cache_v's earlier rows are in no step: the rows it holds, with their row_offset. */
  CHECK_R(diffrun_dump_reader_get(r, "cache_v-0", 1, &x, &dims, &ndim, &row_offset), 0, r, "", "");
  CHECK(x && ndim == 3 && dims[0] == 1 && row_offset == 3 && x[0] == cache_value(3, 0, 0),
        "cache_v-0: [%lld, ...], row_offset %lld", dims ? (long long)dims[0] : -1LL, (long long)row_offset);
  /* The last rows of kq_soft_max and result_output, with their row_offset. */
  CHECK_R(diffrun_dump_reader_get(r, "kq_soft_max-0", 0, &x, &dims, &ndim, &row_offset), 0, r, "", "");
  CHECK(x && ndim == 3 && dims[0] == H && dims[1] == 2 && dims[2] == T0 && row_offset == 1 && x[5] == 2.5f,
        "kq_soft_max-0: row_offset %lld", (long long)row_offset);
  CHECK_R(diffrun_dump_reader_get(r, "result_output", 0, &x, NULL, NULL, &row_offset), 0, r, "", "");
  CHECK(x && row_offset == 2 && x[0] == -4.0f && x[9] == 5.0f, "result_output: row_offset %lld", (long long)row_offset);

  /* Errors name the file, the step and the dataset. */
  CHECK_R(diffrun_dump_reader_get(r, "Qcur-0", 1, &x, &dims, &ndim, &row_offset), DIFFRUN_DUMP_E_CHECKPOINT, r,
          "step_0001/Qcur-0': not in the dump", path);
  CHECK(x == NULL && dims == NULL && ndim == 0, "a failed get leaves data set");
  CHECK_R(diffrun_dump_reader_get(r, "cache_k-0", 9, &x, &dims, &ndim, &row_offset), DIFFRUN_DUMP_E_STEP, r,
          "no step 9 (group 'step_0009')", path);
  CHECK_R(diffrun_dump_reader_get(r, "tokens", 0, &x, &dims, &ndim, &row_offset), DIFFRUN_DUMP_E_CHECKPOINT, r,
          "holds integer ids", "diffrun_dump_reader_tokens");
  CHECK_R(diffrun_dump_reader_get(r, NULL, 0, &x, &dims, &ndim, &row_offset), DIFFRUN_DUMP_E_ARG, r, "name is NULL", "");
  CHECK_R(diffrun_dump_reader_get(r, "embd", 0, NULL, &dims, &ndim, &row_offset), DIFFRUN_DUMP_E_ARG, r, "data is NULL", "");
  CHECK_R(diffrun_dump_reader_get(NULL, "embd", 0, &x, &dims, &ndim, &row_offset), DIFFRUN_DUMP_E_ARG, NULL,
          "handle is NULL", "");
  CHECK(diffrun_dump_reader_close(r) == DIFFRUN_DUMP_OK, "close");
  CHECK(diffrun_dump_reader_close(NULL) == DIFFRUN_DUMP_OK, "close(NULL)");

  r = (diffrun_dump_reader*)1;
  CHECK_R(diffrun_dump_reader_open("no-such-dir/missing.h5", &r), DIFFRUN_DUMP_E_IO, NULL, "no-such-dir/missing.h5", "no such file");
  CHECK(r == NULL, "a failed open leaves *out set");
  CHECK_R(diffrun_dump_reader_open(not_a_dump, &r), DIFFRUN_DUMP_E_IO, NULL, not_a_dump, "not an HDF5 file");
  CHECK_R(diffrun_dump_reader_open(NULL, &r), DIFFRUN_DUMP_E_ARG, NULL, "path is NULL", "");
  CHECK_R(diffrun_dump_reader_open(path, NULL), DIFFRUN_DUMP_E_ARG, NULL, "out is NULL", "");
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: test_capi_reader OUT.h5 NOT_A_DUMP_FILE\n");
    return 2;
  }
  if (write_dump(argv[1]) != 0) return 1;
  read_dump(argv[1], argv[2]);
  printf("test_capi_reader: %d checks, %d failed\n", n_checks, n_failed);
  return n_failed ? 1 : 0;
}
