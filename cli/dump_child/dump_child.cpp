// diffrun-dump-child: writes one dump for a diffrun process, which talks to it over its standard
// input (dump/dump_target.hpp). Not meant to be run by hand.
#include <unistd.h>

#include <cstdio>

#include "dump/dump_target.hpp"

int main(int argc, char**) {
  if (argc > 1 || ::isatty(STDIN_FILENO)) {
    std::fputs("diffrun-dump-child writes a dump for diffrun, which starts it; it takes no arguments\n", stderr);
    return 2;
  }
  return diffrun::dump_child_main(STDIN_FILENO);
}
