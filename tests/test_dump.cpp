// Tests of the HDF5 dump writer and reader: round trip, atomic finish, dataset attributes, bad files.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <regex>

#include "dump/dump.hpp"
#include "model/error.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;

ModelConfig tiny_config() {
  ModelConfig c;
  c.arch = Arch::qwen3;
  c.n_layer = 2;
  c.n_embd = 6;
  c.n_head = 3;
  c.n_head_kv = 1;
  c.head_dim = 2;
  c.n_ff = 10;
  c.n_vocab = 13;
  c.n_ctx = 32;
  c.rope_theta = 1000000.0;
  c.rope_type = RopeType::neox;
  c.rms_eps = 1e-6;
  c.tied_output = true;
  c.qkv_bias = false;
  c.qk_norm = true;
  return c;
}

DumpMeta tiny_meta() {
  DumpMeta m;
  m.backend = "cpu";
  m.precision = "f64";
  m.model_path = "fixtures/tiny-qwen3.gguf";
  m.model_fingerprint = "size=1234;fnv1a64=0123456789abcdef";
  m.config = tiny_config();
  m.prompt = "Bonjour, \xc3\xa7" "a va? \xe2\x9c\x93";  // UTF-8
  m.token_ids = {1, 5, 7, 12};
  m.created_utc = "2024-05-06T07:08:09Z";
  m.diffrun_version = "9.8.7";
  m.facts = {{"device", "Eigen, 2 threads"}, {"tf32", "off"}, {"math_mode", "default"}};
  return m;
}

std::vector<float> ramp(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

class DumpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_scratch_dir("test-dump");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }

  fs::path dir_;

  // Records one step of a subset of checkpoints of tiny_config(): T tokens, S cached positions.
  static void record_step(DumpWriter& w, int step, int T, int S) {
    const ModelConfig c = tiny_config();
    std::vector<int32_t> ids(T);
    std::iota(ids.begin(), ids.end(), 3 + step);
    w.record_ids(step, "tokens", ids);
    auto rec = [&](const char* base, int layer, NativeDType dt) {
      const CheckpointKind& k = *find_checkpoint_kind(base);
      const auto shape = checkpoint_shape(c, k, T, S);
      size_t n = 1;
      for (auto d : shape) n *= d;
      // record out of execution order on purpose: the reader sorts by `order`
      w.record(step, checkpoint_name(base, layer), layer, k.layout, shape, dt,
               ramp(n, 100.0f * static_cast<float>(step) + static_cast<float>(layer + 1)));
    };
    rec("result_output", -1, NativeDType::f32);
    rec("Qnorm", 1, NativeDType::f16);
    rec("kq_soft_max", 0, NativeDType::f32);
    rec("cache_k", 1, NativeDType::f16);
    rec("embd", -1, NativeDType::f32);
  }
};

TEST_F(DumpTest, RoundTripOfEveryAttributeAndDataset) {
  const std::string p = path("run.h5");
  uint64_t bytes = 0;
  {
    DumpWriter w(p, tiny_meta());
    record_step(w, 0, 4, 4);
    record_step(w, 1, 1, 5);
    w.set_attribute("argmax", {9, 8});
    w.set_attribute("argmax", {9, 8, 7});  // replaced, not duplicated
    bytes = w.bytes_written();
    w.finish();
  }
  ASSERT_TRUE(fs::exists(p));
  EXPECT_EQ(files(), std::vector<std::string>{"run.h5"});
  // step 0: ids 4 + logits 4*13 + Qnorm 4*3*2 + softmax 3*4*4 + cache 4*1*2 + embd 4*6
  // step 1: ids 1 + 1*13 + 1*3*2 + 3*1*5 + 1*1*2 (the cache row step 1 wrote) + 1*6
  EXPECT_EQ(bytes, 4u * (4 + 52 + 24 + 48 + 8 + 24 + 1 + 13 + 6 + 15 + 2 + 6));

  const DumpReader r(p);
  EXPECT_EQ(r.path(), p);
  const DumpMeta want = tiny_meta();
  const DumpMeta& got = r.meta();
  EXPECT_EQ(got.format_version, kDumpFormatVersion);
  EXPECT_EQ(got.backend, want.backend);
  EXPECT_EQ(got.precision, want.precision);
  EXPECT_EQ(got.model_path, want.model_path);
  EXPECT_EQ(got.model_fingerprint, want.model_fingerprint);
  EXPECT_EQ(got.prompt, want.prompt);
  EXPECT_EQ(got.token_ids, want.token_ids);
  EXPECT_EQ(got.created_utc, want.created_utc);
  EXPECT_EQ(got.diffrun_version, want.diffrun_version);
  EXPECT_EQ(got.facts, want.facts);
  const ModelConfig& a = got.config;
  const ModelConfig& b = want.config;
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.n_embd, b.n_embd);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.n_head_kv, b.n_head_kv);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.n_ff, b.n_ff);
  EXPECT_EQ(a.n_vocab, b.n_vocab);
  EXPECT_EQ(a.n_ctx, b.n_ctx);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_type, b.rope_type);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.tied_output, b.tied_output);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(r.int_attribute("argmax"), (std::vector<int32_t>{9, 8, 7}));
  EXPECT_EQ(r.int_attribute_names(), std::vector<std::string>{"argmax"});
  EXPECT_TRUE(r.int_attribute("absent").empty());

  EXPECT_EQ(r.steps(), (std::vector<int>{0, 1}));
  const ModelConfig c = tiny_config();
  for (int step : {0, 1}) {
    const int T = step == 0 ? 4 : 1, S = step == 0 ? 4 : 5;
    const auto ds = r.datasets(step);
    std::vector<std::string> names;
    for (const auto& d : ds) names.push_back(d.name);
    EXPECT_EQ(names, (std::vector<std::string>{"tokens", "embd", "kq_soft_max-0", "Qnorm-1", "cache_k-1",
                                               "result_output"}));
    for (const auto& d : ds) {
      const auto p2 = parse_checkpoint_name(d.name);
      EXPECT_EQ(d.step, step);
      EXPECT_EQ(d.order, checkpoint_order(c, p2.base, p2.layer)) << d.name;
      EXPECT_EQ(d.layer, p2.layer) << d.name;
      EXPECT_EQ(d.layout, find_checkpoint_kind(p2.base)->layout) << d.name;
      EXPECT_EQ(d.shape, checkpoint_shape(c, *find_checkpoint_kind(p2.base), T, S)) << d.name;
      EXPECT_EQ(d.is_int, d.name == "tokens") << d.name;
    }
    EXPECT_EQ(r.find(step, "Qnorm-1")->native_dtype, "f16");
    EXPECT_EQ(r.find(step, "embd")->native_dtype, "f32");
    EXPECT_EQ(r.find(step, "tokens")->native_dtype, "i32");
    std::vector<int32_t> ids(T);
    std::iota(ids.begin(), ids.end(), 3 + step);
    EXPECT_EQ(r.read_ids(step, "tokens"), ids);
    const auto q = r.read(step, "Qnorm-1");
    EXPECT_EQ(q, ramp(static_cast<size_t>(T) * 3 * 2, 100.0f * static_cast<float>(step) + 2.0f));
    EXPECT_EQ(r.read(step, "result_output"), ramp(static_cast<size_t>(T) * 13, 100.0f * static_cast<float>(step)));
  }
  EXPECT_EQ(r.find(0, "Qcur-0"), nullptr);
  EXPECT_EQ(r.find(7, "embd"), nullptr);
}

TEST_F(DumpTest, WriterFillsTimeAndVersion) {
  DumpMeta m = tiny_meta();
  m.created_utc.clear();
  m.diffrun_version.clear();
  m.facts.clear();
  {
    DumpWriter w(path("t.h5"), m);
    w.finish();
  }
  const DumpReader r(path("t.h5"));
  EXPECT_TRUE(std::regex_match(r.meta().created_utc, std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << r.meta().created_utc;
  EXPECT_EQ(r.meta().diffrun_version, DIFFRUN_VERSION);
  EXPECT_TRUE(r.meta().facts.empty());
  EXPECT_TRUE(r.steps().empty());
}

TEST_F(DumpTest, NothingLooksWholeBeforeFinishAndAnInterruptedWriterLeavesNothing) {
  const std::string p = path("run.h5");
  {
    DumpWriter w(p, tiny_meta());
    record_step(w, 0, 3, 3);
    EXPECT_FALSE(fs::exists(p));
    ASSERT_EQ(files().size(), 1u);
    EXPECT_NE(files()[0].find("run.h5.diffrun-tmp-"), std::string::npos);
  }
  EXPECT_TRUE(files().empty());
}

// The temporary's name is predictable ("<path>.diffrun-tmp-<pid>"), so it is created exclusively: a
// symlink planted there (to a victim file, to nothing, to a FIFO) is refused and never written
// through; a regular file there is a killed run's leftover (its pid now ours) and is replaced.
TEST_F(DumpTest, TheTemporaryIsCreatedExclusivelyNeverThroughASymlink) {
  const std::string p = path("x.h5");
  const std::string tmp = dump_temporary_path(p, static_cast<long>(::getpid()));
  std::ofstream(path("victim.txt")) << "secret";
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  for (const std::string& target : {path("victim.txt"), path("nowhere"), path("fifo")}) {
    SCOPED_TRACE(target);
    fs::create_symlink(target, tmp);
    try {
      DumpWriter w(p, tiny_meta());
      ADD_FAILURE() << "a symlink at the temporary's name was written through";
    } catch (const DumpError& e) {
      EXPECT_NE(std::string(e.what()).find("it exists and is a symbolic link"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(tmp), std::string::npos) << e.what();
    }
    EXPECT_TRUE(fs::is_symlink(tmp));
    EXPECT_FALSE(fs::exists(p));
    fs::remove(tmp);
  }
  std::ifstream in(path("victim.txt"));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "secret");
  EXPECT_FALSE(fs::exists(path("nowhere")));
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
  // A leftover regular file: replaced, and the dump is written.
  std::ofstream(tmp) << "a killed run's bytes";
  {
    DumpWriter w(p, tiny_meta());
    record_step(w, 0, 3, 3);
    w.finish();
  }
  EXPECT_EQ(DumpReader(p).steps(), std::vector<int>{0});
  EXPECT_FALSE(fs::exists(tmp));
}

// A dump is renamed over its path, which would replace a device node (`dump --out /dev/null` as
// root), a FIFO or a socket with a regular file: an existing non-regular path is refused.
TEST_F(DumpTest, AnExistingNonRegularPathIsRefusedNotReplaced) {
  ASSERT_EQ(::mkfifo(path("fifo.h5").c_str(), 0600), 0);
  fs::create_directory(path("dir.h5"));
  fs::create_symlink("/dev/null", path("null.h5"));
  for (const auto& [name, what] : {std::pair{"fifo.h5", "is a FIFO"}, std::pair{"dir.h5", "is a directory"},
                                   std::pair{"null.h5", "is a character device"}}) {
    SCOPED_TRACE(name);
    try {
      DumpWriter w(path(name), tiny_meta());
      ADD_FAILURE() << "no error";
    } catch (const DumpError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("exists and ") + what), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_fifo(path("fifo.h5")));
  EXPECT_TRUE(fs::is_directory(path("dir.h5")));
  EXPECT_TRUE(fs::is_symlink(path("null.h5")));
  // Only those three: no temporary left behind.
  EXPECT_EQ(files().size(), 3u);
}

TEST_F(DumpTest, FinishReplacesAnOlderFile) {
  const std::string p = path("run.h5");
  {
    std::ofstream(p) << "old";
  }
  DumpWriter w(p, tiny_meta());
  w.finish();
  w.finish();  // a second finish is a no-op
  EXPECT_NO_THROW(DumpReader{p});
  EXPECT_THROW(w.record_ids(0, "tokens", std::vector<int32_t>{1}), DumpError);
}

// Whether some process holds `path` open after its name was removed (a /proc/*/fd link to "<path> (deleted)").
bool held_after_removal(const std::string& path) {
  std::error_code ec;
  for (const auto& proc : fs::directory_iterator("/proc", ec)) {
    std::error_code e2;
    for (const auto& fd : fs::directory_iterator(proc.path() / "fd", e2)) {
      std::error_code e3;
      if (fs::read_symlink(fd.path(), e3).string() == path + " (deleted)") return true;
    }
  }
  return false;
}

// A replaced dump (held open over the rename) is released in the background only once the job the dump child
// writes for (its parent) has ended: held while the job runs, freed soon after it ends. Here a forked "job" forks
// the "dump child".
TEST_F(DumpTest, AReplacedDumpIsFreedAfterTheJobEnds) {
  const std::string old = path("engine.h5");
  { std::ofstream(old) << "old dump"; }
  const pid_t job = ::fork();
  ASSERT_GE(job, 0);
  if (job == 0) {
    const pid_t child = ::fork();
    if (child == 0) {
      const int fd = ::open(old.c_str(), O_RDONLY);
      ::unlink(old.c_str());  // as the rename over it does
      release_replaced_dumps_in_background();
      release_replaced_dump(fd);
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    ::usleep(300'000);
    ::_exit(held_after_removal(old) ? 0 : 1);  // still held while the job runs
  }
  int status = 0;
  ASSERT_EQ(::waitpid(job, &status, 0), job);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "freed while the job was running";
  for (int i = 0; i < 100 && held_after_removal(old); ++i) ::usleep(50'000);
  EXPECT_FALSE(held_after_removal(old)) << "still held after the job ended";
}

TEST_F(DumpTest, FilterSelectsButTokensAreAlwaysRecorded) {
  const std::string p = path("f.h5");
  {
    DumpWriter w(p, tiny_meta(), CheckpointFilter("kq_*,result_*"));
    EXPECT_TRUE(w.wants("tokens"));
    EXPECT_TRUE(w.wants("kq_soft_max-1"));
    EXPECT_FALSE(w.wants("embd"));
    record_step(w, 0, 2, 2);
    w.finish();
  }
  const DumpReader r(p);
  std::vector<std::string> names;
  for (const auto& d : r.datasets(0)) names.push_back(d.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tokens", "kq_soft_max-0", "result_output"}));
  // orders stay canonical (gaps where checkpoints were filtered out)
  EXPECT_EQ(r.find(0, "result_output")->order, static_cast<int>(checkpoint_names(tiny_config()).size()) - 1);
}

TEST_F(DumpTest, StepsMayBeResumed) {
  const std::string p = path("resume.h5");
  {
    DumpWriter w(p, tiny_meta());
    const std::vector<float> e(6, 1.0f);
    const int64_t shape[2] = {1, 6};
    w.record(0, "embd", -1, "T,D", shape, NativeDType::f32, e);
    w.record(1, "embd", -1, "T,D", shape, NativeDType::f32, e);
    w.record(0, "l_out-0", 0, "T,D", shape, NativeDType::f32, e);
    EXPECT_THROW(w.record(0, "embd", -1, "T,D", shape, NativeDType::f32, e), DumpError);  // twice in step 0
    w.finish();
  }
  const DumpReader r(p);
  EXPECT_EQ(r.datasets(0).size(), 2u);
  EXPECT_EQ(r.datasets(1).size(), 1u);
}

// Runs `fn`, expects a DumpError whose message contains every one of `parts`.
template <class Fn>
void expect_dump_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no DumpError";
  } catch (const DumpError& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(DumpTest, WriterRejectsCheckpointsThatDoNotFitTheVocabulary) {
  const std::string p = path("bad.h5");
  DumpWriter w(p, tiny_meta());
  const std::vector<float> v(6, 0.0f);
  const int64_t td[2] = {1, 6};
  const int64_t flat[2] = {1, 6};
  const int64_t q3[3] = {1, 3, 2};
  expect_dump_error([&] { w.record(0, "bogus", -1, "T,D", td, NativeDType::f32, v); }, {p, "step_0000/bogus"});
  expect_dump_error([&] { w.record(0, "Qcur-5", 5, "T,H,Dh", q3, NativeDType::f32, v); }, {p, "Qcur-5", "layer 5"});
  expect_dump_error([&] { w.record(0, "Qcur-1", 0, "T,H,Dh", q3, NativeDType::f32, v); }, {p, "Qcur-1", "layer"});
  expect_dump_error([&] { w.record(0, "Qcur-0", 0, "T,H*Dh", flat, NativeDType::f32, v); },
                    {p, "Qcur-0", "T,H,Dh"});
  expect_dump_error([&] { w.record(0, "Qcur-0", 0, "T,H,Dh", flat, NativeDType::f32, v); },
                    {p, "Qcur-0", "dimensions"});
  expect_dump_error([&] { w.record(0, "embd", -1, "T,D", td, NativeDType::f32, std::vector<float>(5)); },
                    {p, "embd", "5 were passed"});
  expect_dump_error([&] { w.record_ids(0, "embd", std::vector<int32_t>{1}); }, {p, "embd", "layout"});
  DumpMeta m = tiny_meta();
  m.facts["arch"] = "x";
  expect_dump_error([&] { DumpWriter w2(path("facts.h5"), m); }, {"facts.h5", "arch"});
  expect_dump_error([&] { w.set_attribute("n_layer", {1}); }, {p, "n_layer"});
  expect_dump_error([&] { DumpWriter w3(path("no/such/dir/x.h5"), tiny_meta()); }, {"no/such/dir/x.h5"});
}

TEST_F(DumpTest, ReaderErrorsNameTheFile) {
  expect_dump_error([&] { DumpReader r(path("missing.h5")); }, {"missing.h5", "no such file"});

  const std::string text = path("notes.h5");
  std::ofstream(text) << "this is not HDF5\n";
  expect_dump_error([&] { DumpReader r(text); }, {text, "not an HDF5 file"});

  // A foreign HDF5 file: valid HDF5, no diffrun attributes.
  const std::string foreign = path("foreign.h5");
  {
    hid_t f = H5Fcreate(foreign.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    H5Fclose(f);
  }
  expect_dump_error([&] { DumpReader r(foreign); }, {foreign, "not a diffrun dump"});

  // A truncated dump: the HDF5 signature is intact, the rest is cut.
  const std::string whole = path("whole.h5");
  {
    DumpWriter w(whole, tiny_meta());
    record_step(w, 0, 8, 8);
    w.finish();
  }
  const std::string cut = path("cut.h5");
  fs::copy_file(whole, cut);
  fs::resize_file(cut, fs::file_size(whole) / 2);
  expect_dump_error([&] { DumpReader r(cut); }, {cut});

  // A newer format version.
  DumpMeta m = tiny_meta();
  m.format_version = kDumpFormatVersion + 1;
  const std::string newer = path("newer.h5");
  {
    DumpWriter w(newer, m);
    w.finish();
  }
  expect_dump_error([&] { DumpReader r(newer); }, {newer, "format_version 3", "not supported"});

  // A missing dataset and ids read from a float dataset.
  const DumpReader r(whole);
  expect_dump_error([&] { (void)r.read(0, "Qcur-0"); }, {whole, "step_0000/Qcur-0", "no such dataset"});
  expect_dump_error([&] { (void)r.read(3, "embd"); }, {whole, "step_0003/embd"});
  expect_dump_error([&] { (void)r.read_ids(0, "embd"); }, {whole, "step_0000/embd"});
  expect_dump_error([&] { (void)r.datasets(4); }, {whole, "step_0004"});
}

// A version-1 reference stored its strings variable-length: copying them (the C API's
// diffrun_dump_copy_meta) writes fixed-length ones, as version 2 stores every string.
TEST_F(DumpTest, CopiedVariableLengthStringsBecomeFixedLength) {
  const std::string src = path("v1-meta.h5");
  {
    hid_t f = H5Fcreate(src.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    hid_t vlen = H5Tcopy(H5T_C_S1);
    H5Tset_size(vlen, H5T_VARIABLE);
    H5Tset_cset(vlen, H5T_CSET_UTF8);
    hid_t scalar = H5Screate(H5S_SCALAR);
    for (const auto& [name, value] : {std::pair<const char*, const char*>{"model_fingerprint", "123:00ff"},
                                      {"prompt", "Caf\xc3\xa9"}}) {
      hid_t a = H5Acreate2(f, name, vlen, scalar, H5P_DEFAULT, H5P_DEFAULT);
      const char* p = value;
      ASSERT_GE(H5Awrite(a, vlen, &p), 0);
      H5Aclose(a);
    }
    const int32_t n = 7;
    hid_t a = H5Acreate2(f, "n_layer", H5T_STD_I32LE, scalar, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT32, &n);
    H5Aclose(a);
    H5Sclose(scalar);
    H5Tclose(vlen);
    H5Fclose(f);
  }
  const std::string out = path("copied.h5");
  DumpFile d(out);
  // Read only when DIFFRUN_READ_V1=1 says the file is trusted (HDF5 1.10 can crash on a damaged one).
  expect_dump_error([&] { (void)d.copy_attributes(src, [](std::string_view) { return true; }); },
                    {src, "'model_fingerprint' is a variable-length string", "DIFFRUN_READ_V1=1"});
  setenv("DIFFRUN_READ_V1", "1", 1);
  const std::vector<std::string> copied = d.copy_attributes(src, [](std::string_view) { return true; });
  unsetenv("DIFFRUN_READ_V1");
  EXPECT_EQ(copied, (std::vector<std::string>{"model_fingerprint", "n_layer", "prompt"}));
  d.finish();
  hid_t f = H5Fopen(out.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const auto& [name, value] : {std::pair<const char*, std::string>{"model_fingerprint", "123:00ff"},
                                    {"prompt", "Caf\xc3\xa9"}}) {
    hid_t a = H5Aopen(f, name, H5P_DEFAULT);
    hid_t t = H5Aget_type(a);
    EXPECT_EQ(H5Tis_variable_str(t), 0) << name;
    EXPECT_EQ(H5Tget_size(t), value.size()) << name;
    EXPECT_EQ(H5Tget_cset(t), H5T_CSET_UTF8) << name;
    std::string got(H5Tget_size(t), '\0');
    EXPECT_GE(H5Aread(a, t, got.data()), 0);
    EXPECT_EQ(got, value) << name;
    H5Tclose(t);
    H5Aclose(a);
  }
  H5Fclose(f);
}

TEST_F(DumpTest, DatasetsAreContiguousFloat32WithTypedAttributes) {
  const std::string p = path("types.h5");
  {
    DumpWriter w(p, tiny_meta());
    record_step(w, 0, 2, 2);
    w.finish();
  }
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t ds = H5Dopen2(f, "/step_0000/Qnorm-1", H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  hid_t t = H5Dget_type(ds);
  EXPECT_TRUE(H5Tequal(t, H5T_IEEE_F32LE) > 0);
  H5Tclose(t);
  hid_t dcpl = H5Dget_create_plist(ds);
  EXPECT_EQ(H5Pget_layout(dcpl), H5D_CONTIGUOUS);
  EXPECT_EQ(H5Pget_nfilters(dcpl), 0);
  H5Pclose(dcpl);
  // Format version 2: no attributes on the datasets, one attribute table per step.
  EXPECT_EQ(H5Aexists(ds, "layout"), 0);
  EXPECT_EQ(H5Aexists(ds, "order"), 0);
  H5Dclose(ds);
  ds = H5Dopen2(f, "/step_0000/_attributes", H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  t = H5Dget_type(ds);
  ASSERT_EQ(H5Tget_class(t), H5T_COMPOUND);
  for (const char* col : {"name", "layout", "native_dtype", "dtype"}) {
    const int i = H5Tget_member_index(t, col);
    ASSERT_GE(i, 0) << col;
    hid_t mt = H5Tget_member_type(t, static_cast<unsigned>(i));
    EXPECT_EQ(H5Tget_class(mt), H5T_STRING) << col;
    EXPECT_EQ(H5Tis_variable_str(mt), 0) << col;
    EXPECT_EQ(H5Tget_cset(mt), H5T_CSET_UTF8) << col;
    H5Tclose(mt);
  }
  for (const char* col : {"order", "layer", "row_offset"}) {
    const int i = H5Tget_member_index(t, col);
    ASSERT_GE(i, 0) << col;
    hid_t mt = H5Tget_member_type(t, static_cast<unsigned>(i));
    EXPECT_TRUE(H5Tequal(mt, H5T_STD_I32LE) > 0) << col;
    H5Tclose(mt);
  }
  H5Tclose(t);
  H5Dclose(ds);
  // Root strings are fixed-length, sized to the value.
  hid_t a = H5Aopen(f, "format", H5P_DEFAULT);
  hid_t at = H5Aget_type(a);
  EXPECT_EQ(H5Tget_class(at), H5T_STRING);
  EXPECT_EQ(H5Tis_variable_str(at), 0);
  EXPECT_EQ(H5Tget_size(at), std::string(kDumpFormat).size());
  EXPECT_EQ(H5Tget_cset(at), H5T_CSET_UTF8);
  H5Tclose(at);
  H5Aclose(a);
  hid_t g = H5Gopen2(f, "step_0000", H5P_DEFAULT);
  const std::vector<AttributeRow> rows = read_attribute_table(g, "step_0000", 1 << 30);
  H5Gclose(g);
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows[0].name, "tokens");
  EXPECT_EQ(rows[0].attrs.order, 0);
  EXPECT_EQ(rows[0].attrs.layout, "T");
  EXPECT_EQ(rows[0].attrs.native_dtype, "i32");
  EXPECT_FALSE(rows[0].attrs.row_offset.has_value());
  ds = H5Dopen2(f, "/step_0000/tokens", H5P_DEFAULT);
  t = H5Dget_type(ds);
  EXPECT_TRUE(H5Tequal(t, H5T_STD_I32LE) > 0);
  H5Tclose(t);
  H5Dclose(ds);
  H5Fclose(f);
}

}  // namespace
}  // namespace diffrun
