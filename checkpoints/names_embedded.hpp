// The name maps of fixtures/names/*.json, compiled into the library by checkpoints/CMakeLists.txt.
#pragma once

#include <string_view>
#include <vector>

namespace diffrun {

struct EmbeddedNameMap {
  std::string_view name;  // file name without .json: "llamacpp"
  std::string_view text;  // the JSON text
};

// Sorted by name. Defined in the generated embedded_name_maps.cpp.
const std::vector<EmbeddedNameMap>& embedded_name_maps();

}  // namespace diffrun
