// libFuzzer target for the tolerance-file parser: any text must parse or give an InputError, within bounded memory.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "diff/tolerances.hpp"
#include "model/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    diffrun::diff::parse_tolerances(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.json");
  } catch (const diffrun::InputError&) {
  }
  return 0;
}
