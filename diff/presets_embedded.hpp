// The tolerance presets of fixtures/tolerances/*.json, compiled into the library by diff/CMakeLists.txt.
#pragma once

#include <string_view>
#include <vector>

namespace diffrun::diff {

struct EmbeddedPreset {
  std::string_view name;  // file name without .json: "f32_vs_f64"
  std::string_view text;  // the JSON text
};

// Sorted by name. Defined in the generated embedded_presets.cpp.
const std::vector<EmbeddedPreset>& embedded_presets();

}  // namespace diffrun::diff
