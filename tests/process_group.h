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

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
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

inline int FreePort(std::set<int>& taken) {
  for (int tries = 0; tries < 1000; ++tries) {
    const int port = 20000 + (std::rand() % 30000);
    if (taken.count(port) == 0 && PortFree(port)) {
      taken.insert(port);
      return port;
    }
  }
  return 0;
}

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
