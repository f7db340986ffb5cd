// The JSON and JUnit reports of a run that ends with exit 2, written from main where the error is caught.
#pragma once

#include <string>

namespace diffrun::cli {

// Writes `error` as the --report-json and --report-junit reports that argv asks for (also when the
// command line itself was refused), so CI shows why the run could not be done. A report that cannot
// be written is noted on stderr; nothing is thrown.
void write_error_reports(int argc, const char* const* argv, const std::string& error);

}  // namespace diffrun::cli
