#include "bench/loadgen/http_load.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "nlohmann/json.hpp"

namespace mlaserve::bench {
namespace {

using Clock = std::chrono::steady_clock;

int Connect(const std::string& host, int port, bool blocking) {
  const int fd = socket(AF_INET, SOCK_STREAM | (blocking ? 0 : SOCK_NONBLOCK), 0);
  if (fd < 0) {
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET /v1/models on a connection of its own: the served model's name, or "".
std::string FirstModel(const HttpLoadOptions& o) {
  const int fd = Connect(o.host, o.port, /*blocking=*/true);
  if (fd < 0) {
    return "";
  }
  std::string req = "GET /v1/models HTTP/1.1\r\nHost: " + o.host + "\r\nConnection: close\r\n";
  if (!o.api_key.empty()) {
    req += "Authorization: Bearer " + o.api_key + "\r\n";
  }
  req += "\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t at = out.find("\r\n\r\n");
  if (at == std::string::npos) {
    return "";
  }
  const auto j = nlohmann::json::parse(out.substr(at + 4), nullptr, false);
  if (!j.is_object() || !j.contains("data") || j["data"].empty()) {
    return "";
  }
  return j["data"][0].value("id", "");
}

struct Connection {
  int fd = -1;
  int request = -1;  // index into the specs, -1 when idle
  std::string out;
  size_t out_at = 0;
  std::string in;   // bytes read, not yet parsed
  std::string sse;  // body bytes (de-chunked), not yet split into events
  enum class State { kHead, kChunkSize, kChunkData, kBodyToClose, kDone } state = State::kHead;
  size_t chunk_left = 0;
  bool done_event = false;   // "data: [DONE]" seen
  bool waiting_out = false;  // registered for EPOLLOUT
};

class Runner {
 public:
  Runner(const HttpLoadOptions& o, const std::vector<HttpRequestSpec>& specs, std::string model)
      : o_(o), specs_(specs), model_(std::move(model)), epoll_(epoll_create1(0)) {
    report_.results.resize(specs.size());
  }
  ~Runner() { close(epoll_); }

  HttpLoadReport Run() {
    const auto t0 = Clock::now();
    const int n = std::min<int>(o_.concurrency, static_cast<int>(specs_.size()));
    conns_.resize(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      StartNext(i);
    }
    std::vector<epoll_event> events(1024);
    while (finished_ < static_cast<int>(specs_.size())) {
      const int k = epoll_wait(epoll_, events.data(), static_cast<int>(events.size()), 60000);
      if (k <= 0) {
        report_.error = "no event for 60 s";
        break;
      }
      const auto now = Clock::now();
      for (int e = 0; e < k; ++e) {
        const int i = static_cast<int>(events[e].data.u32);
        if (events[e].events & EPOLLOUT) {
          Flush(i);
        }
        if (events[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
          Receive(i, now);
        }
      }
    }
    for (Connection& c : conns_) {
      if (c.fd >= 0) {
        close(c.fd);
      }
    }
    report_.wall_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return std::move(report_);
  }

 private:
  // Gives connection i the next request (connecting first when it has no socket).
  void StartNext(int i) {
    Connection& c = conns_[i];
    if (next_ >= static_cast<int>(specs_.size())) {
      if (c.fd >= 0) {
        close(c.fd);
        c.fd = -1;
      }
      c.request = -1;
      return;
    }
    if (c.fd < 0) {
      c.fd = Connect(o_.host, o_.port, /*blocking=*/false);
      if (c.fd < 0) {
        Fail(i, next_++, "connect failed");
        return;
      }
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT;  // until connected and the request is written
      ev.data.u32 = static_cast<uint32_t>(i);
      epoll_ctl(epoll_, EPOLL_CTL_ADD, c.fd, &ev);
      c.waiting_out = true;
    }
    c.request = next_++;
    const HttpRequestSpec& s = specs_[c.request];
    nlohmann::json body = {{"model", model_},
                           {"prompt", s.prompt},
                           {"max_tokens", s.max_tokens},
                           {"ignore_eos", true},
                           {"temperature", 0},
                           {"stream", true},
                           {"stream_options", {{"include_usage", true}}}};
    const std::string text = body.dump();
    c.out = "POST /v1/completions HTTP/1.1\r\nHost: " + o_.host +
            "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(text.size()) +
            "\r\n" + (o_.api_key.empty() ? "" : "Authorization: Bearer " + o_.api_key + "\r\n") +
            "\r\n" + text;
    c.out_at = 0;
    c.in.clear();
    c.sse.clear();
    c.state = Connection::State::kHead;
    c.done_event = false;
    report_.results[c.request].sent = Clock::now();
    Flush(i);
  }

  // Writes what it can of the request; waits for EPOLLOUT only while some of it is left (a
  // level-triggered EPOLLOUT on a writable socket would wake epoll_wait at once, every time).
  void Flush(int i) {
    Connection& c = conns_[i];
    while (c.fd >= 0 && c.out_at < c.out.size()) {
      const ssize_t n = write(c.fd, c.out.data() + c.out_at, c.out.size() - c.out_at);
      if (n < 0) {
        if (errno != EAGAIN && errno != EINPROGRESS && errno != ENOTCONN) {
          Drop(i, "write failed");
          return;
        }
        break;
      }
      c.out_at += static_cast<size_t>(n);
    }
    if (c.fd < 0) {
      return;
    }
    const bool want_out = c.out_at < c.out.size();
    if (want_out != c.waiting_out) {
      epoll_event ev{};
      ev.events = EPOLLIN | (want_out ? EPOLLOUT : 0);
      ev.data.u32 = static_cast<uint32_t>(i);
      epoll_ctl(epoll_, EPOLL_CTL_MOD, c.fd, &ev);
      c.waiting_out = want_out;
    }
  }

  void Receive(int i, Clock::time_point now) {
    Connection& c = conns_[i];
    char buf[65536];
    for (;;) {
      if (c.fd < 0) {
        return;
      }
      const ssize_t n = read(c.fd, buf, sizeof(buf));
      if (n < 0) {
        if (errno == EAGAIN) {
          return;
        }
        Drop(i, std::string("read failed: ") + std::strerror(errno));
        return;
      }
      if (n == 0) {
        if (c.state == Connection::State::kBodyToClose && c.done_event) {
          Complete(i, /*reuse=*/false);
        } else {
          Drop(i, "the server closed the connection");
        }
        return;
      }
      c.in.append(buf, static_cast<size_t>(n));
      Parse(i, now);
    }
  }

  void Parse(int i, Clock::time_point now) {
    Connection& c = conns_[i];
    for (;;) {
      switch (c.state) {
        case Connection::State::kHead: {
          const size_t at = c.in.find("\r\n\r\n");
          if (at == std::string::npos) {
            return;
          }
          const std::string head = c.in.substr(0, at);
          c.in.erase(0, at + 4);
          if (head.compare(0, 12, "HTTP/1.1 200") != 0) {
            Drop(i, "HTTP " + head.substr(9, 3) + ": " + c.in.substr(0, 300));
            return;
          }
          c.state = head.find("Transfer-Encoding: chunked") != std::string::npos
                        ? Connection::State::kChunkSize
                        : Connection::State::kBodyToClose;
          break;
        }
        case Connection::State::kChunkSize: {
          const size_t eol = c.in.find("\r\n");
          if (eol == std::string::npos) {
            return;
          }
          c.chunk_left = std::stoul(c.in.substr(0, eol), nullptr, 16);
          c.in.erase(0, eol + 2);
          if (c.chunk_left == 0) {
            if (c.in.size() < 2) {  // the CRLF after the last chunk
              c.in.insert(0, "0\r\n");
              return;
            }
            c.in.erase(0, 2);
            c.state = Connection::State::kDone;
            Events(i, now);
            Complete(i, /*reuse=*/true);
            return;
          }
          c.state = Connection::State::kChunkData;
          break;
        }
        case Connection::State::kChunkData: {
          if (c.in.size() < c.chunk_left + 2) {
            return;
          }
          c.sse.append(c.in, 0, c.chunk_left);
          c.in.erase(0, c.chunk_left + 2);
          c.state = Connection::State::kChunkSize;
          Events(i, now);
          break;
        }
        case Connection::State::kBodyToClose:
          c.sse += c.in;
          c.in.clear();
          Events(i, now);
          return;
        case Connection::State::kDone:
          return;
      }
    }
  }

  // Splits the complete SSE events out of the body read so far.
  void Events(int i, Clock::time_point now) {
    Connection& c = conns_[i];
    HttpRequestResult& r = report_.results[c.request];
    size_t at;
    while ((at = c.sse.find("\n\n")) != std::string::npos) {
      const std::string event = c.sse.substr(0, at);
      c.sse.erase(0, at + 2);
      if (event.rfind("data: ", 0) != 0) {
        continue;  // a comment (": waiting")
      }
      if (event == "data: [DONE]") {
        c.done_event = true;
      } else if (event.find("\"error\":") != std::string::npos &&
                 event.find("\"choices\"") == std::string::npos) {
        r.error = event.substr(6, 300);
      } else if (event.find("\"choices\":[]") != std::string::npos) {
        const auto j = nlohmann::json::parse(event.substr(6), nullptr, false);
        if (j.is_object() && j.contains("usage")) {
          r.tokens = j["usage"].value("completion_tokens", 0);
        }
      } else if (event.find("\"finish_reason\":null") != std::string::npos) {
        if (r.events == 0) {
          r.first = now;
          ++open_;
          report_.peak_open_streams = std::max(report_.peak_open_streams, open_);
        } else {
          r.gaps.push_back(std::chrono::duration<double>(now - r.last).count());
        }
        r.last = now;
        ++r.events;
      }
    }
  }

  void Complete(int i, bool reuse) {
    Connection& c = conns_[i];
    HttpRequestResult& r = report_.results[c.request];
    if (!c.done_event && r.error.empty()) {
      r.error = "the stream ended without [DONE]";
    }
    if (r.tokens == 0 && r.error.empty()) {
      r.error = "no usage chunk";
    }
    if (r.events > 0) {
      --open_;
    }
    ++finished_;
    c.request = -1;
    if (!reuse) {
      epoll_ctl(epoll_, EPOLL_CTL_DEL, c.fd, nullptr);
      close(c.fd);
      c.fd = -1;
    }
    StartNext(i);
  }

  void Fail(int i, int request, const std::string& why) {
    report_.results[request].error = why;
    ++finished_;
    (void)i;
  }

  // The connection broke: its request failed; the next one gets a new connection.
  void Drop(int i, const std::string& why) {
    Connection& c = conns_[i];
    if (c.fd >= 0) {
      epoll_ctl(epoll_, EPOLL_CTL_DEL, c.fd, nullptr);
      close(c.fd);
      c.fd = -1;
    }
    if (c.request >= 0) {
      HttpRequestResult& r = report_.results[c.request];
      if (r.error.empty()) {
        r.error = why;
      }
      if (r.events > 0) {
        --open_;
      }
      ++finished_;
      c.request = -1;
    }
    StartNext(i);
  }

  const HttpLoadOptions& o_;
  const std::vector<HttpRequestSpec>& specs_;
  const std::string model_;
  const int epoll_;
  std::vector<Connection> conns_;
  HttpLoadReport report_;
  int next_ = 0, finished_ = 0, open_ = 0;
};

}  // namespace

HttpLoadReport RunHttpLoad(const HttpLoadOptions& options,
                           const std::vector<HttpRequestSpec>& specs) {
  std::string model = options.model.empty() ? FirstModel(options) : options.model;
  if (model.empty()) {
    HttpLoadReport r;
    r.error =
        "no model from GET /v1/models at " + options.host + ":" + std::to_string(options.port);
    return r;
  }
  return Runner(options, specs, std::move(model)).Run();
}

}  // namespace mlaserve::bench
