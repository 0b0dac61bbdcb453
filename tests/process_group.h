// Processes the tests start from the outside (the launcher, mpirun jobs, binaries): spawned in a
// process group of their own so that teardown reaches everything they started (mpirun's ranks),
// waited for with a timeout; and free TCP ports for them.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace mlaserve {

// Free on every interface (the worker socket binds 0.0.0.0).
inline bool PortFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// Ports for the processes a test starts are taken from outside the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default): a port inside it that is free
// when checked can be taken before its server binds it by any outgoing connection or by mpirun's
// own listeners (a CI run lost the coordinator's metrics port that way: "Possible problem binding
// to port"). The candidates are 10000 up to the range's start, and above its end.
inline std::vector<std::pair<int, int>> NonEphemeralPortRanges() {
  int lo = 32768, hi = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &lo, &hi) != 2) {
      lo = 32768;
      hi = 60999;
    }
    std::fclose(f);
  }
  std::vector<std::pair<int, int>> ranges;  // [first, last]
  if (lo > 10000) {
    ranges.push_back({10000, lo - 1});
  }
  if (hi < 65535) {
    ranges.push_back({std::max(hi + 1, 10000), 65535});
  }
  if (ranges.empty()) {
    ranges.push_back({10000, 65535});  // everything is ephemeral: nothing better to do
  }
  return ranges;
}

// `count` consecutive ports inside one of those ranges, free on every interface, none of them in
// `taken` (which gets them); 0 if none was found.
inline int FreePorts(int count, std::set<int>& taken) {
  std::vector<std::pair<int, int>> bases;  // [first, last] of the block's first port
  long total = 0;
  for (const auto& [first, last] : NonEphemeralPortRanges()) {
    if (last - first + 1 >= count) {
      bases.push_back({first, last - count + 1});
      total += last - count + 1 - first + 1;
    }
  }
  for (int tries = 0; total > 0 && tries < 1000; ++tries) {
    long pick = std::rand() % total;
    int base = 0;
    for (const auto& [first, last] : bases) {
      if (pick < last - first + 1) {
        base = first + static_cast<int>(pick);
        break;
      }
      pick -= last - first + 1;
    }
    bool ok = true;
    for (int i = 0; i < count && ok; ++i) {
      ok = taken.count(base + i) == 0 && PortFree(base + i);
    }
    if (ok) {
      for (int i = 0; i < count; ++i) {
        taken.insert(base + i);
      }
      return base;
    }
  }
  return 0;
}

inline int FreePort(std::set<int>& taken) { return FreePorts(1, taken); }

// Starts `args` in a process group of its own (so that teardown reaches mpirun's ranks), stdout
// and stderr to `log`, with `env` (NAME=VALUE) added to this process's environment.
inline pid_t Spawn(const std::vector<std::string>& args, const std::string& log,
                   const std::vector<std::string>& env = {}) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> argv, envp;
  for (const auto& a : args) {
    argv.push_back(const_cast<char*>(a.c_str()));
  }
  argv.push_back(nullptr);
  for (char** e = environ; *e != nullptr; ++e) {
    envp.push_back(*e);
  }
  for (const auto& e : env) {
    envp.push_back(const_cast<char*>(e.c_str()));
  }
  envp.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &fa, &attr, argv.data(), envp.data()) != 0) {
    pid = -1;
  }
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  return pid;
}

// Exit status, 128 + signal, or -1 if still running after `timeout`.
inline int WaitFor(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  do {
    int st;
    const pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    if (r < 0) {
      return -2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  return -1;
}

// A process group this test started: SIGTERM, then SIGKILL to the group, when it goes out of
// scope or is stopped.
struct Group {
  pid_t pid = -1;
  ~Group() { Stop(std::chrono::seconds(10)); }
  int Stop(std::chrono::seconds grace) {
    if (pid <= 0) {
      return -1;
    }
    kill(pid, SIGTERM);
    int rc = WaitFor(pid, grace);
    if (rc == -1) {
      kill(-pid, SIGKILL);
      rc = WaitFor(pid, std::chrono::seconds(5));
    }
    kill(-pid, SIGKILL);  // what is left of the group (ranks of a killed mpirun)
    pid = -1;
    return rc;
  }
  // Reaps it if it has exited by itself (status as WaitFor).
  int Exited(std::chrono::milliseconds timeout) {
    const int rc = WaitFor(pid, timeout);
    if (rc != -1) {
      kill(-pid, SIGKILL);
      pid = -1;
    }
    return rc;
  }
};

}  // namespace mlaserve
