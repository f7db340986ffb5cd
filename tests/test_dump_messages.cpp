// Messages of the dump layer that the C API passes on: a checkpoint name with '_' for '-', dims that do
// not match the layout given, copy_attributes from a FIFO, has_dataset("").
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "dump/dump_format.hpp"
#include "dump/dump_validate.hpp"
#include "model/config.hpp"
#include "model/error.hpp"

namespace diffrun {
namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.arch = Arch::llama;
  c.n_layer = 2;
  c.n_embd = 8;
  c.n_head = 2;
  c.n_head_kv = 1;
  c.head_dim = 4;
  c.n_ff = 12;
  c.n_vocab = 32;
  c.n_ctx = 16;
  return c;
}

TEST(DumpMessages, UnderscoreLayerIsNotACheckpointName) {
  const std::vector<int64_t> shape = {3, 8};
  const std::string p = check_checkpoint(tiny_config(), "attn_norm_0", 0, shape, "", 3, 3);
  EXPECT_NE(p.find("'attn_norm_0' is not a checkpoint name"), std::string::npos) << p;
  EXPECT_NE(p.find("did you mean 'attn_norm-0'?"), std::string::npos) << p;
  EXPECT_EQ(p.find("layer -1"), std::string::npos) << p;
  // The layer check itself still holds for a real name.
  EXPECT_NE(check_checkpoint(tiny_config(), "attn_norm-1", 0, shape, "", 3, 3).find("layer 1"), std::string::npos);
}

TEST(DumpMessages, DimsNotMatchingTheGivenLayoutNameBoth) {
  const std::vector<int64_t> shape = {3, 2, 4};  // [T, H, Dh] given as "H,T,Dh"
  const std::string p = check_checkpoint(tiny_config(), "Qcur-0", 0, shape, "H,T,Dh", 3, 3);
  EXPECT_NE(p.find("shape [3, 2, 4] does not fit layout 'H,T,Dh' = [2, 3, 4]"), std::string::npos) << p;
  EXPECT_NE(p.find("the dims do not match the layout given with them"), std::string::npos) << p;
  EXPECT_EQ(p.find("needs its layout attribute"), std::string::npos) << p;
  // Without a layout, the same element count still points at the layout attribute.
  const std::vector<int64_t> permuted = {2, 3, 4};
  EXPECT_NE(check_checkpoint(tiny_config(), "Qcur-0", 0, permuted, "", 3, 3).find("needs its layout attribute"),
            std::string::npos);
}

TEST(DumpMessages, CopyFromAFifoNamesIt) {
  const auto dir = std::filesystem::temp_directory_path() / ("diffrun-msg-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  {
    DumpFile f((dir / "out.h5").string());
    try {
      f.copy_attributes(fifo, [](std::string_view) { return true; });
      ADD_FAILURE() << "no error";
    } catch (const DumpError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("FIFO"), std::string::npos) << what;
      EXPECT_EQ(what.find("no such file"), std::string::npos) << what;
    }
    try {
      f.copy_attributes((dir / "missing.h5").string(), [](std::string_view) { return true; });
      ADD_FAILURE() << "no error";
    } catch (const DumpError& e) {
      EXPECT_NE(std::string(e.what()).find("no such file"), std::string::npos) << e.what();
    }
    // "" names no dataset of a step (the C API's put("") said "recorded twice").
    const int32_t ids[1] = {1};
    const int64_t n[1] = {1};
    f.write(0, "tokens", StoredDType::i32, n, ids, {});
    EXPECT_FALSE(f.has_dataset(0, ""));
    EXPECT_TRUE(f.has_dataset(0, "tokens"));
    f.abort();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace diffrun
