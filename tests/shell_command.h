// Runs a shell command for the tests that drive the project's scripts and binaries from the
// outside (the launcher, keygen): its exit code and its stdout and stderr together.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace mlaserve {

struct ShellOutcome {
  int rc = -1;      // exit code; -1 when killed by a signal
  std::string out;  // stdout and stderr
};

inline ShellOutcome RunShell(const std::string& cmd) {
  ShellOutcome r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace mlaserve
