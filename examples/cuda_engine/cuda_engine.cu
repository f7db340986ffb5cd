// cuda_engine.cu: a small llama engine in CUDA (F16 weights from a GGUF, cuBLAS) whose decode step is one
// captured CUDA graph, debugged with diffrun through the C API's deferred device puts (one copy kernel a
// layer), recorded inside the graph.
//
//   diffrun dump --backend cpu --precision f64 --model M.gguf --prompt "Hello" --steps 4 --out ref.h5
//   cuda_engine --model M.gguf --reference ref.h5 --out mine.h5      # teacher-forced on ref.h5's tokens
//   diffrun compare mine.h5 ref.h5
//
// Precision: f16 weights and GEMM inputs, f32 accumulation, f32 residual stream, norms, RoPE, softmax and KV
// cache (the dump says precision "f16": compare uses the f16_vs_f64 preset). The prefill runs op by op; the
// decode step (one token) is captured into a CUDA graph that reads its position from device memory (d_pos,
// which the graph advances), so it replays at every position; captured twice, the two graphs taking turns.
//
// --bug rope-pos   decode steps rotate q and k at position n_past + 1  -> first divergence Qrope-0 at step 1
// --bench N        N runs recorded and N unrecorded; prints the median decode ms/token of each and the ratio
// --immediate      record with diffrun_dump_put_device (one copy each, at the put) instead of deferred puts
// --probe          exit 0 when a CUDA device is present, 77 when not
// Exit status: 0 done, 1 a CUDA/diffrun failure, 2 bad input, 77 no CUDA device.
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <diffrun/dump_writer.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#define CUDA_CHECK(x) check_cuda((x), #x, __LINE__)
#define CUBLAS_CHECK(x) check_cublas((x), #x, __LINE__)
#define DR_CHECK(x) check_dump((x), #x, __LINE__)

static diffrun_dump* g_dump = nullptr;  // the dump being written, for DR_CHECK's message

static void check_cuda(cudaError_t rc, const char* what, int line) {
  if (rc == cudaSuccess) return;
  std::fprintf(stderr, "cuda_engine: line %d: %s: %s\n", line, what, cudaGetErrorString(rc));
  std::exit(1);
}
static void check_cublas(cublasStatus_t rc, const char* what, int line) {
  if (rc == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "cuda_engine: line %d: %s: cuBLAS status %d\n", line, what, static_cast<int>(rc));
  std::exit(1);
}
static void check_dump(int rc, const char* what, int line) {
  if (rc == DIFFRUN_DUMP_OK) return;
  std::fprintf(stderr, "cuda_engine: line %d: %s: %s: %s\n", line, what, diffrun_dump_strerror(rc),
               diffrun_dump_last_error(g_dump));
  std::exit(1);
}
[[noreturn]] static void bad_input(const std::string& what) {
  std::fprintf(stderr, "cuda_engine: %s\n", what.c_str());
  std::exit(2);
}

// ---- GGUF: the metadata numbers and the F32/F16 tensors of a llama model --------------------------------

struct Tensor {
  std::vector<int64_t> ne;  // ne[0] is the fastest dimension (a matrix [rows][cols] has ne = {cols, rows})
  uint32_t type;            // 0 F32, 1 F16
  const uint8_t* data;
};

struct Gguf {
  std::map<std::string, double> num;
  std::map<std::string, std::string> str;
  std::map<std::string, uint64_t> array_len;
  std::map<std::string, Tensor> tensors;
};

static Gguf read_gguf(const char* path) {
  const int fd = open(path, O_RDONLY);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) bad_input(std::string(path) + ": cannot open");
  const size_t size = static_cast<size_t>(st.st_size);
  auto* base = static_cast<const uint8_t*>(mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0));
  close(fd);
  if (base == MAP_FAILED) bad_input(std::string(path) + ": cannot map");
  size_t pos = 0;
  auto take = [&](size_t n) {
    if (pos + n > size) bad_input(std::string(path) + ": truncated GGUF");
    const uint8_t* p = base + pos;
    pos += n;
    return p;
  };
  auto u32 = [&] { uint32_t v; std::memcpy(&v, take(4), 4); return v; };
  auto u64 = [&] { uint64_t v; std::memcpy(&v, take(8), 8); return v; };
  auto string = [&] { const uint64_t n = u64(); return std::string(reinterpret_cast<const char*>(take(n)), n); };
  static const size_t scalar_size[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
  auto number = [&](uint32_t t) -> double {
    const uint8_t* p = take(scalar_size[t]);
    switch (t) {
      case 0: return *p;
      case 1: return static_cast<int8_t>(*p);
      case 2: { uint16_t v; std::memcpy(&v, p, 2); return v; }
      case 3: { int16_t v; std::memcpy(&v, p, 2); return v; }
      case 4: { uint32_t v; std::memcpy(&v, p, 4); return v; }
      case 5: { int32_t v; std::memcpy(&v, p, 4); return v; }
      case 6: { float v; std::memcpy(&v, p, 4); return v; }
      case 7: return *p;
      case 10: { uint64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
      case 11: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
      default: { double v; std::memcpy(&v, p, 8); return v; }
    }
  };
  Gguf g;
  if (std::memcmp(take(4), "GGUF", 4) != 0) bad_input(std::string(path) + ": not a GGUF file");
  const uint32_t version = u32();
  if (version < 2 || version > 3) bad_input(std::string(path) + ": GGUF version " + std::to_string(version));
  const uint64_t n_tensors = u64(), n_kv = u64();
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = string();
    const uint32_t t = u32();
    if (t == 8) {
      g.str[key] = string();
    } else if (t == 9) {
      const uint32_t et = u32();
      const uint64_t n = u64();
      g.array_len[key] = n;
      for (uint64_t j = 0; j < n; ++j) {
        if (et == 8) string();
        else if (et < 13 && scalar_size[et]) take(scalar_size[et]);
        else bad_input(std::string(path) + ": nested array in " + key);
      }
    } else if (t < 13 && scalar_size[t]) {
      g.num[key] = number(t);
    } else {
      bad_input(std::string(path) + ": value type " + std::to_string(t) + " of " + key);
    }
  }
  std::vector<std::pair<std::string, uint64_t>> offsets;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const std::string name = string();
    Tensor t{};
    t.ne.resize(u32());
    for (int64_t& x : t.ne) x = static_cast<int64_t>(u64());
    t.type = u32();
    offsets.emplace_back(name, u64());
    g.tensors[name] = t;
  }
  const uint64_t align = g.num.count("general.alignment") ? static_cast<uint64_t>(g.num["general.alignment"]) : 32;
  const size_t data_start = (pos + align - 1) / align * align;
  for (auto& [name, off] : offsets) g.tensors[name].data = base + data_start + off;
  return g;
}

// ---- the model -------------------------------------------------------------------------------------

struct Config {
  int n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab;
  float rope_theta, rms_eps;
};

struct Layer {
  float *attn_norm, *ffn_norm;
  half *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;
};

struct Model {
  Config c;
  half *tok_embd, *output;  // output: output.weight, or tok_embd when tied
  float* output_norm;
  std::vector<Layer> layers;
};

static const Tensor& tensor(const Gguf& g, const std::string& name, std::vector<int64_t> ne) {
  auto it = g.tensors.find(name);
  if (it == g.tensors.end()) bad_input("tensor " + name + " missing");
  if (it->second.ne != ne) bad_input("tensor " + name + " has an unexpected shape");
  if (it->second.type > 1) bad_input("tensor " + name + ": type " + std::to_string(it->second.type) +
                                     " (this example reads F32 and F16 only)");
  return it->second;
}

static size_t count(const Tensor& t) {
  size_t n = 1;
  for (int64_t x : t.ne) n *= static_cast<size_t>(x);
  return n;
}

// An F16 matrix on the device (F32 ones rounded to F16).
static half* upload_f16(const Gguf& g, const std::string& name, std::vector<int64_t> ne) {
  const Tensor& t = tensor(g, name, ne);
  std::vector<half> h(count(t));
  if (t.type == 1) std::memcpy(h.data(), t.data, h.size() * 2);
  else for (size_t i = 0; i < h.size(); ++i) h[i] = __float2half(reinterpret_cast<const float*>(t.data)[i]);
  half* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, h.size() * 2));
  CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

// An F32 vector on the device (F16 ones widened).
static float* upload_f32(const Gguf& g, const std::string& name, int64_t n) {
  const Tensor& t = tensor(g, name, {n});
  std::vector<float> f(static_cast<size_t>(n));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = t.type == 0 ? reinterpret_cast<const float*>(t.data)[i]
                       : __half2float(reinterpret_cast<const half*>(t.data)[i]);
  float* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, f.size() * 4));
  CUDA_CHECK(cudaMemcpy(d, f.data(), f.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

static Model load_model(const char* path) {
  const Gguf g = read_gguf(path);
  auto key = [&](const std::string& k, double fallback = NAN) {
    auto it = g.num.find("llama." + k);
    if (it != g.num.end()) return it->second;
    if (std::isnan(fallback)) bad_input(std::string(path) + ": no llama." + k);
    return fallback;
  };
  auto arch = g.str.find("general.architecture");
  if (arch == g.str.end() || arch->second != "llama") bad_input(std::string(path) + ": not a llama model");
  if (g.tensors.count("rope_freqs.weight")) bad_input(std::string(path) + ": RoPE scaling is not supported here");
  Model m{};
  Config& c = m.c;
  c.n_layer = static_cast<int>(key("block_count"));
  c.n_embd = static_cast<int>(key("embedding_length"));
  c.n_ff = static_cast<int>(key("feed_forward_length"));
  c.n_head = static_cast<int>(key("attention.head_count"));
  c.n_head_kv = static_cast<int>(key("attention.head_count_kv", c.n_head));
  c.head_dim = static_cast<int>(key("attention.key_length", c.n_embd / c.n_head));
  c.rope_theta = static_cast<float>(key("rope.freq_base", 10000.0));
  c.rms_eps = static_cast<float>(key("attention.layer_norm_rms_epsilon"));
  const int64_t rows = g.tensors.count("token_embd.weight") ? g.tensors.at("token_embd.weight").ne.at(1) : 0;
  auto vocab = g.array_len.find("tokenizer.ggml.tokens");
  c.n_vocab = static_cast<int>(vocab != g.array_len.end() ? vocab->second : rows);
  const int64_t D = c.n_embd, F = c.n_ff, Q = int64_t(c.n_head) * c.head_dim, KV = int64_t(c.n_head_kv) * c.head_dim;
  m.tok_embd = upload_f16(g, "token_embd.weight", {D, rows});
  m.output = g.tensors.count("output.weight") ? upload_f16(g, "output.weight", {D, rows}) : m.tok_embd;
  m.output_norm = upload_f32(g, "output_norm.weight", D);
  for (int l = 0; l < c.n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    m.layers.push_back({upload_f32(g, b + "attn_norm.weight", D), upload_f32(g, b + "ffn_norm.weight", D),
                        upload_f16(g, b + "attn_q.weight", {D, Q}), upload_f16(g, b + "attn_k.weight", {D, KV}),
                        upload_f16(g, b + "attn_v.weight", {D, KV}), upload_f16(g, b + "attn_output.weight", {Q, D}),
                        upload_f16(g, b + "ffn_gate.weight", {D, F}), upload_f16(g, b + "ffn_up.weight", {D, F}),
                        upload_f16(g, b + "ffn_down.weight", {F, D})});
  }
  return m;
}

// ---- kernels (one block per row unless said; every position comes from *pos, the tokens before this step) ----

constexpr int kThreads = 256;

// The sum (or max) of `v` over the block; every thread gets it.
template <bool Max>
__device__ float block_reduce(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = Max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = (blockDim.x + 31) / 32;
  __syncthreads();  // part[] may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < n_warps ? part[lane] : (Max ? -INFINITY : 0.f);
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = Max ? fmaxf(v, w) : v + w;
  }
  return v;
}

__global__ void embed(const half* table, const int* tokens, const int* pos, int D, float* out) {
  const int t = blockIdx.x, token = tokens[*pos + t];
  for (int i = threadIdx.x; i < D; i += blockDim.x) out[size_t(t) * D + i] = __half2float(table[size_t(token) * D + i]);
}

// out = x / sqrt(mean(x^2) + eps) * w, in f32 and rounded to f16 (the next GEMM's input).
__global__ void rms_norm(const float* x, const float* w, float eps, int D, float* out, half* out16) {
  const size_t row = size_t(blockIdx.x) * D;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) ss += x[row + i] * x[row + i];
  const float scale = rsqrtf(block_reduce<false>(ss) / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float y = x[row + i] * scale * w[i];
    out[row + i] = y;
    out16[row + i] = __float2half(y);
  }
}

// llama's RoPE: pair (2i, 2i+1) of each head of row t rotated by (position) * theta^(-2i/Dh).
__global__ void rope(const float* in, const int* pos, int n_heads, int Dh, float theta, int shift, float* out) {
  const int t = blockIdx.x, pairs = n_heads * Dh / 2;
  const float p = static_cast<float>(*pos + t + shift);
  for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
    const int i = j % (Dh / 2);
    float s, c;
    sincosf(p * powf(theta, -2.f * i / Dh), &s, &c);
    const size_t k = size_t(t) * n_heads * Dh + 2 * size_t(j);
    const float a = in[k], b = in[k + 1];
    out[k] = a * c - b * s;
    out[k + 1] = a * s + b * c;
  }
}

// Rows t of k and v into the cache at position *pos + t.
__global__ void store_kv(const float* k, const float* v, const int* pos, int kv_dim, float* cache_k, float* cache_v) {
  const int t = blockIdx.x;
  const size_t dst = size_t(*pos + t) * kv_dim, src = size_t(t) * kv_dim;
  for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
    cache_k[dst + i] = k[src + i];
    cache_v[dst + i] = v[src + i];
  }
}

// Causal attention of query row t, head h (grid H x T) over cache positions 0 .. *pos + t.
// Shared memory: q (Dh floats), then one score per position.
__global__ void attention(const float* q, const float* cache_k, const float* cache_v, const int* pos, int H, int Hkv,
                          int Dh, float scale, float* out) {
  extern __shared__ float sh[];
  float *qs = sh, *score = sh + Dh;
  const int h = blockIdx.x, t = blockIdx.y, S = *pos + t + 1, kvh = h / (H / Hkv), kv_dim = Hkv * Dh;
  const float* qrow = q + (size_t(t) * H + h) * Dh;
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) qs[d] = qrow[d];
  __syncthreads();
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const float* k = cache_k + size_t(s) * kv_dim + size_t(kvh) * Dh;
    float dot = 0.f;
    for (int d = 0; d < Dh; ++d) dot += qs[d] * k[d];
    score[s] = dot * scale;
    mx = fmaxf(mx, score[s]);
  }
  mx = block_reduce<true>(mx);
  float sum = 0.f;
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    score[s] = expf(score[s] - mx);
    sum += score[s];
  }
  sum = block_reduce<false>(sum);  // its __syncthreads also publishes score[]
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += score[s] * cache_v[size_t(s) * kv_dim + size_t(kvh) * Dh + d];
    out[(size_t(t) * H + h) * Dh + d] = acc / sum;
  }
}

__global__ void to_half(const float* x, int n, half* out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = __float2half(x[i]);
}

__global__ void add(const float* a, const float* b, int n, float* out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = a[i] + b[i];
}

__global__ void swiglu(const float* gate, const float* up, int n, float* out, half* out16) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float y = gate[i] / (1.f + expf(-gate[i])) * up[i];
    out[i] = y;
    out16[i] = __float2half(y);
  }
}

__global__ void advance(int* pos, int T) { *pos += T; }

// ---- the engine ------------------------------------------------------------------------------------

struct Engine {
  Model m;
  int max_t, max_s;  // rows of a step (the prompt), positions in all
  bool bug_rope_pos = false;
  bool immediate_puts = false;  // --immediate: diffrun_dump_put_device instead of the deferred puts
  cudaStream_t stream;
  cublasHandle_t blas;
  int *d_tokens, *d_pos;
  float *x, *xn, *q, *k, *v, *qr, *kr, *att, *ao, *h, *hn, *gate, *up, *sw, *fo, *logits;
  half* x16;
  std::vector<float*> cache_k, cache_v;
  diffrun_dump* dump = nullptr;  // recording when set

  float* alloc(size_t n) {
    float* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
    return p;
  }

  Engine(Model model, int max_t_, int max_s_) : m(model), max_t(max_t_), max_s(max_s_) {
    const Config& c = m.c;
    const size_t T = max_t, D = c.n_embd, F = c.n_ff, Q = size_t(c.n_head) * c.head_dim,
                 KV = size_t(c.n_head_kv) * c.head_dim;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&blas));
    CUBLAS_CHECK(cublasSetStream(blas, stream));  // before the workspace: setting the stream resets it
    void* workspace = nullptr;
    const size_t workspace_bytes = size_t(32) << 20;  // cuBLAS allocates nothing inside the capture
    CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
    CUBLAS_CHECK(cublasSetWorkspace(blas, workspace, workspace_bytes));
    CUDA_CHECK(cudaMalloc(&d_tokens, max_s * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&d_pos, sizeof(int)));
    x = alloc(T * D), xn = alloc(T * D), q = alloc(T * Q), k = alloc(T * KV), v = alloc(T * KV);
    qr = alloc(T * Q), kr = alloc(T * KV), att = alloc(T * Q), ao = alloc(T * D), h = alloc(T * D);
    hn = alloc(T * D), gate = alloc(T * F), up = alloc(T * F), sw = alloc(T * F), fo = alloc(T * D);
    logits = alloc(T * c.n_vocab);
    CUDA_CHECK(cudaMalloc(&x16, T * std::max({D, F, Q}) * sizeof(half)));
    for (int l = 0; l < c.n_layer; ++l) cache_k.push_back(alloc(max_s * KV)), cache_v.push_back(alloc(max_s * KV));
  }

  // y[T, N] = x16[T, K] · W[N, K]^T (row-major), f32 accumulation and output.
  void gemm(const half* W, int N, int K, int T, float* y) {
    const float one = 1.f, zero = 0.f;
    CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, W, CUDA_R_16F, K, x16, CUDA_R_16F, K,
                              &zero, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // A checkpoint [T, cols] in device memory, noted (a deferred device put): copied at the next flush(),
  // so its buffer must keep its values until then.
  void record(const char* name, int layer, const float* data, int T, int cols) {
    if (!dump) return;
    char full[64];
    if (layer >= 0) std::snprintf(full, sizeof full, "%s-%d", name, layer);
    else std::snprintf(full, sizeof full, "%s", name);
    const int64_t dims[2] = {T, cols};
    if (immediate_puts)  // copied now, in stream order: the buffer may change right after
      DR_CHECK(diffrun_dump_put_device(dump, full, layer, dims, 2, DIFFRUN_F32, data, stream));
    else
      DR_CHECK(diffrun_dump_put_device_deferred(dump, full, layer, dims, 2, DIFFRUN_F32, data, stream));
  }
  // Copies what was noted since the last flush, one kernel on the stream (a graph node while capturing):
  // before a noted buffer is overwritten (x, at the end of each layer) and at the end of the pass.
  void flush() {
    if (dump) DR_CHECK(diffrun_dump_flush_device(dump, stream));
  }

  // One forward pass over T tokens at positions *d_pos ..; then *d_pos += T. `decode`: the graph's step.
  void forward(int T, bool decode) {
    const Config& c = m.c;
    const int D = c.n_embd, F = c.n_ff, Dh = c.head_dim, Q = c.n_head * Dh, KV = c.n_head_kv * Dh;
    const int shift = decode && bug_rope_pos ? 1 : 0;
    const int grid = 64;
    embed<<<T, kThreads, 0, stream>>>(m.tok_embd, d_tokens, d_pos, D, x);
    record("embd", -1, x, T, D);
    flush();  // layer 0 writes its l_out over x
    for (int l = 0; l < c.n_layer; ++l) {
      const Layer& w = m.layers[l];
      rms_norm<<<T, kThreads, 0, stream>>>(x, w.attn_norm, c.rms_eps, D, xn, x16);
      record("attn_norm", l, xn, T, D);
      gemm(w.wq, Q, D, T, q);
      gemm(w.wk, KV, D, T, k);
      gemm(w.wv, KV, D, T, v);
      record("Qcur", l, q, T, Q);
      record("Kcur", l, k, T, KV);
      record("Vcur", l, v, T, KV);
      rope<<<T, kThreads, 0, stream>>>(q, d_pos, c.n_head, Dh, c.rope_theta, shift, qr);
      rope<<<T, kThreads, 0, stream>>>(k, d_pos, c.n_head_kv, Dh, c.rope_theta, shift, kr);
      record("Qrope", l, qr, T, Q);
      record("Krope", l, kr, T, KV);
      store_kv<<<T, kThreads, 0, stream>>>(kr, v, d_pos, KV, cache_k[l], cache_v[l]);
      const size_t shared = (Dh + max_s) * sizeof(float);
      attention<<<dim3(c.n_head, T), 128, shared, stream>>>(qr, cache_k[l], cache_v[l], d_pos, c.n_head,
                                                            c.n_head_kv, Dh, 1.f / std::sqrt(float(Dh)), att);
      record("kqv_out", l, att, T, Q);
      to_half<<<grid, kThreads, 0, stream>>>(att, T * Q, x16);
      gemm(w.wo, D, Q, T, ao);
      record("attn_out", l, ao, T, D);
      add<<<grid, kThreads, 0, stream>>>(x, ao, T * D, h);
      record("ffn_inp", l, h, T, D);
      rms_norm<<<T, kThreads, 0, stream>>>(h, w.ffn_norm, c.rms_eps, D, hn, x16);
      record("ffn_norm", l, hn, T, D);
      gemm(w.w_gate, F, D, T, gate);
      gemm(w.w_up, F, D, T, up);
      record("ffn_gate", l, gate, T, F);
      record("ffn_up", l, up, T, F);
      swiglu<<<grid, kThreads, 0, stream>>>(gate, up, T * F, sw, x16);
      record("ffn_swiglu", l, sw, T, F);
      gemm(w.w_down, D, F, T, fo);
      record("ffn_out", l, fo, T, D);
      add<<<grid, kThreads, 0, stream>>>(h, fo, T * D, x);
      record("l_out", l, x, T, D);
      flush();  // the next layer reuses every buffer
    }
    rms_norm<<<T, kThreads, 0, stream>>>(x, m.output_norm, c.rms_eps, D, xn, x16);
    record("result_norm", -1, xn, T, D);
    gemm(m.output, c.n_vocab, D, T, logits);  // the real vocabulary's rows only
    record("result_output", -1, logits, T, c.n_vocab);
    flush();
    advance<<<1, 1, 0, stream>>>(d_pos, T);
    CUDA_CHECK(cudaGetLastError());
  }
};

// One teacher-forced run over every step's ids: the prefill op by op, the decode steps as graph launches.
// Records into `dump` when given. Returns the decode steps' wall time per token in ms (steps 2.., after the
// capture), the host loop until the stream is idle; the file writes at close are not counted.
static double run(Engine& e, diffrun_dump* dump, const std::vector<std::vector<int32_t>>& steps) {
  e.dump = dump;
  const int zero = 0;
  CUDA_CHECK(cudaMemcpyAsync(e.d_pos, &zero, sizeof zero, cudaMemcpyHostToDevice, e.stream));
  auto begin_step = [&](int s) {
    if (!dump) return;
    const int64_t n = static_cast<int64_t>(steps[s].size());
    DR_CHECK(diffrun_dump_step(dump, s));
    DR_CHECK(diffrun_dump_put(dump, "tokens", -1, &n, 1, DIFFRUN_I32, steps[s].data()));
  };
  begin_step(0);
  e.forward(static_cast<int>(steps[0].size()), false);
  if (steps.size() < 2) return 0.0;

  // Step 1: one uncaptured decode pass first (it loads every kernel, cuBLAS's included, outside the capture;
  // it writes the same cache row the captured pass writes again), then the capture.
  begin_step(1);
  diffrun_dump* recording = e.dump;
  e.dump = nullptr;
  e.forward(1, true);
  advance<<<1, 1, 0, e.stream>>>(e.d_pos, -1);  // the warm-up advanced the position: step back
  e.dump = recording;
  // Two captures of the same pass, launched in turn: each has its own staging slots, so a launch never
  // overwrites data the host has not copied out yet, and diffrun_dump_step (which waits for the previous
  // launch and copies its slots out) runs while the GPU computes the launch after it.
  cudaGraph_t graph[2];
  cudaGraphExec_t exec[2];
  int graph_id[2] = {-1, -1};
  for (int g = 0; g < 2; ++g) {
    CUDA_CHECK(cudaStreamBeginCapture(e.stream, cudaStreamCaptureModeGlobal));
    e.forward(1, true);
    CUDA_CHECK(cudaStreamEndCapture(e.stream, &graph[g]));
    CUDA_CHECK(cudaGraphInstantiate(&exec[g], graph[g], 0));
    if (dump) DR_CHECK(diffrun_dump_capture_end(dump, &graph_id[g]));
  }
  CUDA_CHECK(cudaGraphLaunch(exec[0], e.stream));
  if (dump) DR_CHECK(diffrun_dump_replay(dump, graph_id[0], e.stream));
  CUDA_CHECK(cudaStreamSynchronize(e.stream));

  // Step s launches graph (s - 1) % 2 first (step 1 took graph 0), then starts the step in the dump: the
  // step's wait for step s - 1, which ran the other graph, overlaps this launch.
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t s = 2; s < steps.size(); ++s) {
    const int g = static_cast<int>((s - 1) % 2);
    CUDA_CHECK(cudaGraphLaunch(exec[g], e.stream));
    begin_step(static_cast<int>(s));
    if (dump) DR_CHECK(diffrun_dump_replay(dump, graph_id[g], e.stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(e.stream));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (int g = 0; g < 2; ++g) {
    CUDA_CHECK(cudaGraphExecDestroy(exec[g]));
    CUDA_CHECK(cudaGraphDestroy(graph[g]));
  }
  return steps.size() > 2 ? ms / static_cast<double>(steps.size() - 2) : 0.0;
}

// A dump like the reference's, for this engine.
static diffrun_dump* open_dump(const std::string& path, const std::string& reference, const char* bug) {
  DR_CHECK(diffrun_dump_open(path.c_str(), &g_dump));
  DR_CHECK(diffrun_dump_copy_meta(g_dump, reference.c_str()));
  DR_CHECK(diffrun_dump_set_string(g_dump, "backend", "cuda_engine"));
  DR_CHECK(diffrun_dump_set_string(g_dump, "precision", "f16"));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  DR_CHECK(diffrun_dump_set_string(g_dump, "device", prop.name));
  if (bug) DR_CHECK(diffrun_dump_set_string(g_dump, "bug", bug));
  return g_dump;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  std::string model, reference, out, bug_name;
  int bench = 0;
  bool immediate = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : (bad_input(a + " needs a value"), ""); };
    if (a == "--model") model = value();
    else if (a == "--reference") reference = value();
    else if (a == "--out") out = value();
    else if (a == "--bug") bug_name = value();
    else if (a == "--bench") bench = std::atoi(value().c_str());
    else if (a == "--immediate") immediate = true;
    else if (a == "--probe") {
      int n = 0;
      return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? 0 : 77;
    } else bad_input("unknown argument " + a + " (--model M.gguf --reference REF.h5 --out OUT.h5 [--bug rope-pos] "
                     "[--bench N] [--immediate] | --probe)");
  }
  if (model.empty() || reference.empty() || out.empty()) bad_input("--model, --reference and --out are required");
  if (!bug_name.empty() && bug_name != "rope-pos") bad_input("unknown bug " + bug_name + " (rope-pos)");
  const char* bug = bug_name.empty() ? nullptr : bug_name.c_str();
  int n_devices = 0;
  if (cudaGetDeviceCount(&n_devices) != cudaSuccess || n_devices == 0) {
    std::fprintf(stderr, "cuda_engine: no CUDA device\n");
    return 77;
  }
  CUDA_CHECK(cudaSetDevice(0));

  // The ids of every step, from the reference (teacher forcing).
  diffrun_dump* d = open_dump(out, reference, bug);
  std::vector<std::vector<int32_t>> steps;
  const int32_t* ids = nullptr;
  size_t n = 0;
  for (int s = 0; diffrun_dump_step_tokens(d, s, &ids, &n) == DIFFRUN_DUMP_OK; ++s) steps.emplace_back(ids, ids + n);
  if (steps.empty()) bad_input(reference + ": no token ids");
  std::vector<int32_t> all;
  for (const auto& s : steps) all.insert(all.end(), s.begin(), s.end());

  Engine e(load_model(model.c_str()), static_cast<int>(steps[0].size()), static_cast<int>(all.size()));
  e.bug_rope_pos = bug != nullptr;
  e.immediate_puts = immediate;
  for (int32_t id : all)
    if (id < 0 || id >= e.m.c.n_vocab) bad_input("token id " + std::to_string(id) + " outside the model's vocabulary");
  if ((e.m.c.head_dim + all.size()) * sizeof(float) > 48 * 1024) bad_input("too many positions for this example");
  CUDA_CHECK(cudaMemcpy(e.d_tokens, all.data(), all.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());  // the uploads (legacy stream) land before the engine's stream reads them

  run(e, d, steps);
  DR_CHECK(diffrun_dump_close(d));
  std::printf("cuda_engine: wrote %s: %zu steps\n", out.c_str(), steps.size());

  if (bench > 0) {
    if (steps.size() < 4) bad_input("--bench needs a reference with at least 3 decode steps");
    // The recorded runs stage every step in pinned memory (512 MiB): the HDF5 writes then all come at
    // close, timed apart, as a writer beside the engine would take them.
    std::vector<double> recorded, plain, closing;
    const std::string bench_out = out + ".bench.h5";
    for (int r = 0; r < bench; ++r) {
      plain.push_back(run(e, nullptr, steps));
      diffrun_dump* b = open_dump(bench_out, reference, bug);
      DR_CHECK(diffrun_dump_set_staging(b, size_t(512) << 20));
      recorded.push_back(run(e, b, steps));
      const auto t0 = std::chrono::steady_clock::now();
      DR_CHECK(diffrun_dump_close(b));
      closing.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      std::remove(bench_out.c_str());
    }
    const double p = median(plain), q = median(recorded), w = median(closing);
    std::printf("cuda_engine: decode ms/token, median of %d runs of %zu steps: unrecorded %.4f, recorded %.4f, "
                "ratio %.3f; the file's writes at close %.1f ms (%.3f ms a step)\n", bench, steps.size() - 2, p, q,
                p > 0 ? q / p : 0.0, w, w / static_cast<double>(steps.size()));
  }
  return 0;
}
