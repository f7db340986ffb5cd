// python/diffrun/dump_schema.json, compiled into the library by checkpoints/CMakeLists.txt (and capi/CMakeLists.txt).
#pragma once

#include <string_view>
#include <vector>

namespace diffrun {

struct EmbeddedSchema {
  std::string_view name;  // file name without .json: "dump_schema"
  std::string_view text;  // the JSON text
};

// Every python/diffrun/*.json (the schema alone). Defined in the generated embedded_dump_schema.cpp.
const std::vector<EmbeddedSchema>& embedded_dump_schema();

}  // namespace diffrun
