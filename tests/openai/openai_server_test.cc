// mlaserve-openai end to end: a coordinator + `mpirun -np 2` CPU workers on the embedded tiny
// model (DeepSeek-V3's real tokenizer and chat template) behind mlaserve-openai with an API key.
// The official `openai` npm client runs openai_client_test.mjs against it; raw sockets check
// what that client cannot send (malformed requests, oversized or short bodies, slow clients,
// several requests on one kept-alive connection, a client that goes away). Servers of their own
// check overload, drain and a failed worker job.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

#include "coordinator/auth/curve_keys.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/server_fixture.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;

constexpr char kApiKey[] = "test-key-123";

// One HTTP/1.1 exchange on a fresh connection; returns the whole response (headers and body).
std::string RawHttp(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    (void)!write(fd, request.data(), request.size());
    std::string buf(65536, '\0');
    ssize_t n;
    while ((n = read(fd, buf.data(), buf.size())) > 0) out.append(buf.data(), n);
  }
  close(fd);
  return out;
}

// A client connection kept open across requests, reading one response at a time.
class RawConnection {
 public:
  explicit RawConnection(int port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawConnection() { close(fd_); }
  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) {
    return write(fd_, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
  }
  void ShutdownWrite() { shutdown(fd_, SHUT_WR); }

  struct Response {
    int status = -1;
    std::string head, body;  // body de-chunked
  };
  // One response: its head, then a Content-Length body, a chunked body, or everything up to the
  // close. status -1 when none came within `timeout`.
  Response Read(std::chrono::milliseconds timeout = 60s) {
    deadline_ = std::chrono::steady_clock::now() + timeout;
    Response r;
    size_t at;
    while ((at = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return r;
    }
    r.head = buf_.substr(0, at + 4);
    buf_.erase(0, at + 4);
    r.status = StatusOf(r.head);
    std::smatch m;
    if (std::regex_search(r.head, m, std::regex("Content-Length: ([0-9]+)", std::regex::icase))) {
      const size_t n = std::stoul(m[1]);
      while (buf_.size() < n) {
        if (!Fill()) return {};
      }
      r.body = buf_.substr(0, n);
      buf_.erase(0, n);
    } else if (std::regex_search(r.head,
                                 std::regex("Transfer-Encoding: chunked", std::regex::icase))) {
      for (;;) {
        size_t eol;
        while ((eol = buf_.find("\r\n")) == std::string::npos) {
          if (!Fill()) return {};
        }
        const size_t n = std::stoul(buf_.substr(0, eol), nullptr, 16);
        while (buf_.size() < eol + 2 + n + 2) {
          if (!Fill()) return {};
        }
        r.body += buf_.substr(eol + 2, n);
        buf_.erase(0, eol + 2 + n + 2);
        if (n == 0) break;
      }
    } else {
      while (Fill()) {
      }
      r.body = std::move(buf_);
      buf_.clear();
    }
    return r;
  }
  // The bytes received up to and including `marker` (all received so far if it does not come
  // within `timeout`); they stay unread for Read().
  std::string ReadUntil(const std::string& marker, std::chrono::milliseconds timeout) {
    deadline_ = std::chrono::steady_clock::now() + timeout;
    while (buf_.find(marker) == std::string::npos && Fill()) {
    }
    return buf_;
  }
  // Whether the server closes the connection within `timeout` (reads until end of stream).
  bool ClosedWithin(std::chrono::milliseconds timeout) {
    deadline_ = std::chrono::steady_clock::now() + timeout;
    while (Fill()) {
    }
    return eof_;
  }

 private:
  static int StatusOf(const std::string& head) {
    std::smatch m;
    if (std::regex_search(head, m, std::regex("^HTTP/1\\.[01] ([0-9]{3})"))) return std::stoi(m[1]);
    return -1;
  }
  bool Fill() {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline_ - std::chrono::steady_clock::now());
    pollfd p{fd_, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    char buf[65536];
    const ssize_t n = read(fd_, buf, sizeof(buf));
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buf_.append(buf, static_cast<size_t>(n));
    return true;
  }
  int fd_;
  bool connected_ = false;
  bool eof_ = false;
  std::string buf_;
  std::chrono::steady_clock::time_point deadline_;
};

int StatusOf(const std::string& response) {
  std::smatch m;
  if (std::regex_search(response, m, std::regex("^HTTP/1\\.[01] ([0-9]{3})")))
    return std::stoi(m[1]);
  return -1;
}

nlohmann::json BodyOf(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  if (at == std::string::npos) return nullptr;
  return nlohmann::json::parse(response.substr(at + 4), nullptr, false);
}

std::string Post(const std::string& path, const std::string& body, bool auth = true) {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
         (auth ? std::string("Authorization: Bearer ") + kApiKey + "\r\n" : "") +
         "Content-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
}

// A request without "Connection: close": HTTP/1.1 keeps the connection open after it.
std::string PostKeepAlive(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
         "Authorization: Bearer " + kApiKey + "\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

std::string Get(const std::string& path, const std::string& connection = "") {
  return "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + kApiKey +
         "\r\n" + (connection.empty() ? "" : "Connection: " + connection + "\r\n") + "\r\n";
}

// The data events of an SSE body, parsed ("[DONE]" as the string).
std::vector<nlohmann::json> Events(const std::string& body) {
  std::vector<nlohmann::json> out;
  std::istringstream lines(body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    out.push_back(data == "[DONE]" ? nlohmann::json("[DONE]") : nlohmann::json::parse(data));
  }
  return out;
}

// The value of mlaserve_requests_total{finish_reason=REASON} in a metrics text (0 if absent).
double RequestsFinished(const std::string& metrics, const std::string& reason) {
  std::smatch m;
  if (std::regex_search(metrics, m,
                        std::regex("\nmlaserve_requests_total\\{[^}]*finish_reason=\"" + reason +
                                   "\"[^}]*\\} ([0-9.eE+-]+)"))) {
    return std::stod(m[1]);
  }
  return 0;
}

// Starts another mlaserve-openai with `args`; returns its port (0 if it did not start).
int StartFrontEnd(const std::string& args, const std::string& name, pid_t* pid) {
  const auto log = std::filesystem::temp_directory_path() /
                   ("mlaserve-openai-" + name + "-" + std::to_string(getpid()) + ".log");
  const std::string cmd = std::string("exec ") + MLASERVE_OPENAI_BIN + " " + args +
                          " --listen 127.0.0.1:0 > " + log.string() + " 2>&1";
  *pid = fork();
  if (*pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Up to 60 s: with --model it loads the tokenizer first, which took over 10 s in the sanitizer
  // build with the e2e and mpi tests on the same 2 cores.
  for (int i = 0; i < 1200; ++i) {
    std::this_thread::sleep_for(50ms);
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    std::smatch m;
    if (std::regex_search(text, m, std::regex("listening on port ([0-9]+)"))) {
      return std::stoi(m[1]);
    }
  }
  return 0;
}

class OpenAiServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcesses();
    ServerOptions o;
    o.model_dir = MLASERVE_TINY_MODEL_DIR;
    o.kv_blocks = 256;
    start_error_ = server_->Start(o);
    if (!start_error_.empty()) return;
    log_ = std::filesystem::temp_directory_path() /
           ("mlaserve-openai-" + std::to_string(getpid()) + ".log");
    const std::string cmd = std::string("exec ") + MLASERVE_OPENAI_BIN + " --coordinator " +
                            server_->endpoint() + " --listen 127.0.0.1:0 --api-key " + kApiKey +
                            " --model " + MLASERVE_TINY_MODEL_DIR + " > " + log_.string() + " 2>&1";
    http_ = fork();
    if (http_ == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline && port_ <= 0) {
      std::ifstream in(log_);
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      std::smatch m;
      if (std::regex_search(text, m, std::regex("listening on port ([0-9]+)")))
        port_ = std::stoi(m[1]);
      std::this_thread::sleep_for(50ms);
    }
    if (port_ <= 0) start_error_ = "mlaserve-openai did not start: " + Log();
  }
  static void TearDownTestSuite() {
    if (http_ > 0) {
      kill(http_, SIGTERM);
      waitpid(http_, nullptr, 0);
    }
    delete server_;
  }
  void SetUp() override { ASSERT_TRUE(start_error_.empty()) << start_error_; }
  static std::string Log() {
    std::ifstream in(log_);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }

  static inline ServerProcesses* server_ = nullptr;
  static inline std::string start_error_;
  static inline std::filesystem::path log_;
  static inline pid_t http_ = -1;
  static inline int port_ = 0;
};

TEST_F(OpenAiServerTest, HealthIsOpenAndOk) {
  const std::string r =
      RawHttp(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(r), 200) << r;
}

TEST_F(OpenAiServerTest, MalformedJsonIs400) {
  const std::string r =
      RawHttp(port_, Post("/v1/chat/completions", "{\"model\": \"x\", \"messages\": ["));
  EXPECT_EQ(StatusOf(r), 400) << r;
  const auto body = BodyOf(r);
  ASSERT_TRUE(body.is_object()) << r;
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["code"], "invalid_json");
  EXPECT_TRUE(body["error"]["message"].is_string());
  // Valid JSON of the wrong shape is a 400 naming the field.
  const std::string r2 =
      RawHttp(port_, Post("/v1/chat/completions", "{\"model\": 3, \"messages\": []}"));
  EXPECT_EQ(StatusOf(r2), 400) << r2;
  EXPECT_EQ(BodyOf(r2)["error"]["param"], "model");
}

TEST_F(OpenAiServerTest, UnknownRouteIs404AndWrongMethodIs405) {
  const std::string r = RawHttp(port_, Post("/v1/nothing-here", "{}"));
  EXPECT_EQ(StatusOf(r), 404) << r;
  EXPECT_EQ(BodyOf(r)["error"]["code"], "route_not_found");
  const std::string r2 =
      RawHttp(port_, std::string("GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") +
                         "Authorization: Bearer " + kApiKey + "\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(r2), 405) << r2;
}

// An oversized body is answered at once and the connection closed: nothing more is read (civetweb
// would otherwise wait up to its request timeout, 30 s, for the announced bytes).
TEST_F(OpenAiServerTest, BodyOverLimitIs413AndTheConnectionClosesAtOnce) {
  const std::string head = std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\n") +
                           "Authorization: Bearer " + kApiKey +
                           "\r\nContent-Length: 9437184\r\n\r\n";
  for (const size_t sent : {size_t{0}, size_t{1} << 20}) {  // announced only; 1 MiB of 9 sent
    const auto t0 = std::chrono::steady_clock::now();
    RawConnection c(port_);
    ASSERT_TRUE(c.connected());
    c.Send(head + std::string(sent, 'x'));
    const auto r = c.Read(10s);
    EXPECT_EQ(r.status, 413) << r.head;
    EXPECT_NE(r.head.find("Connection: close"), std::string::npos) << r.head;
    EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["code"], "body_too_large");
    EXPECT_TRUE(c.ClosedWithin(5s));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 2.0) << "sent " << sent;
  }
  EXPECT_EQ(StatusOf(RawHttp(port_, Get("/health", "close"))), 200);
}

// Several requests on one connection, as the openai clients' keep-alive agents send them: JSON
// responses carry Content-Length, streams are chunked, and the connection stays open until the
// client asks to close it.
TEST_F(OpenAiServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  RawConnection c(port_);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(Get("/v1/models")));
  auto r = c.Read();
  ASSERT_EQ(r.status, 200) << r.head;
  EXPECT_NE(r.head.find("Connection: keep-alive"), std::string::npos) << r.head;
  const std::string model = nlohmann::json::parse(r.body)["data"][0]["id"];
  const std::string req =
      R"({"model": ")" + model +
      R"(", "prompt": "Once upon", "max_tokens": 6, "temperature": 0, "ignore_eos": true)";
  ASSERT_TRUE(c.Send(PostKeepAlive("/v1/completions", req + "}")));
  r = c.Read();
  ASSERT_EQ(r.status, 200) << r.head << r.body;
  const std::string text = nlohmann::json::parse(r.body)["choices"][0]["text"];
  ASSERT_TRUE(c.Send(PostKeepAlive("/v1/completions", req + R"(, "stream": true})")));
  r = c.Read();
  ASSERT_EQ(r.status, 200) << r.head;
  EXPECT_NE(r.head.find("Transfer-Encoding: chunked"), std::string::npos) << r.head;
  std::string streamed;
  const auto events = Events(r.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  for (const auto& e : events) {
    if (e.is_object()) streamed += e["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(streamed, text);
  // An error answered after its body was read keeps the connection too.
  ASSERT_TRUE(c.Send(PostKeepAlive("/v1/completions", R"({"model": 7})")));
  r = c.Read();
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.head.find("Connection: keep-alive"), std::string::npos) << r.head;
  ASSERT_TRUE(c.Send(Get("/health", "close")));
  r = c.Read();
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.head.find("Connection: close"), std::string::npos) << r.head;
  EXPECT_TRUE(c.ClosedWithin(2s));
}

// What a client library would never send: each is answered (or the connection closed), the
// process survives, and the next client is served.
TEST_F(OpenAiServerTest, MalformedRequestsAreAnsweredAndTheServerKeepsServing) {
  // A body shorter than its Content-Length, the client then done sending.
  {
    RawConnection c(port_);
    c.Send(std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ") +
           kApiKey + "\r\nContent-Length: 100\r\n\r\n{\"model\":");
    c.ShutdownWrite();
    const auto r = c.Read(10s);
    EXPECT_EQ(r.status, 400) << r.head;
    EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["code"], "incomplete_body");
  }
  // Not HTTP, a bad Content-Length, a head over civetweb's 16 kB: civetweb's own 4xx.
  for (const std::string& raw :
       {std::string("HELLO\r\n\r\n"),
        std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ab\r\n\r\n"),
        std::string("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ") + std::string(20000, 'a') +
            "\r\n\r\n"}) {
    const std::string r = RawHttp(port_, raw);
    EXPECT_TRUE(r.empty() || (StatusOf(r) >= 400 && StatusOf(r) < 500)) << r.substr(0, 200);
  }
  const std::string chat = R"({"model": "tiny-deepseek-v3", "messages": )";
  struct Bad {
    std::string body, param;
  };
  const std::vector<Bad> bad = {
      // 200,000 nested arrays: valid JSON, not an object (and no stack overflow).
      {std::string(200000, '[') + std::string(200000, ']'), ""},
      // Invalid UTF-8 inside a string.
      {chat + "[{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}", ""},
      {chat + R"([{"role": "assistant", "tool_calls": [1]}]})", "messages[0].tool_calls[0]"},
      {chat + R"([{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]})",
       "messages[0].tool_calls[0].function.name"},
      {chat + R"([{"role": "user", "content": {"text": "x"}}]})", "messages[0].content"},
      {chat + R"([{"role": "robot", "content": "x"}]})", "messages[0].role"},
      {chat + R"([{"role": "user", "content": "x"}], "max_tokens": -1})", "max_tokens"},
      {chat + R"([{"role": "user", "content": "x"}], "stream": "yes"})", "stream"},
      {chat + R"([{"role": "user", "content": "x"}], "n": 1e9})", "n"},
      {chat + R"([{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})",
       "chat_template_kwargs"},
      {chat + R"([{"role": "user", "content": "x"}], "reasoning_effort": "high"})",
       "reasoning_effort"},
  };
  for (const Bad& b : bad) {
    const std::string r = RawHttp(port_, Post("/v1/chat/completions", b.body));
    EXPECT_EQ(StatusOf(r), 400) << b.body.substr(0, 120) << "\n" << r.substr(0, 400);
    const auto body = BodyOf(r);
    ASSERT_TRUE(body.is_object()) << r.substr(0, 400);
    if (!b.param.empty()) EXPECT_EQ(body["error"]["param"], b.param) << r;
  }
  EXPECT_EQ(StatusOf(RawHttp(port_, Get("/health", "close"))), 200);
}

// A client that stops sending its request is cut after --client-timeout-s; the others are served
// meanwhile.
TEST_F(OpenAiServerTest, SlowClientIsCutAndOthersAreServed) {
  pid_t pid;
  const int port =
      StartFrontEnd("--coordinator " + server_->endpoint() + " --client-timeout-s 2", "slow", &pid);
  ASSERT_GT(port, 0);
  RawConnection slow(port);
  ASSERT_TRUE(slow.connected());
  slow.Send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le");
  RawConnection slow_body(port);
  slow_body.Send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"mo");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string ok =
      RawHttp(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(ok), 200) << ok;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  EXPECT_TRUE(slow.ClosedWithin(6s));
  const auto r = slow_body.Read(6s);  // the body never completes: 400 (or closed)
  EXPECT_EQ(r.status, 400) << r.head;
  // Each was cut once, after 2 s (not after 2 s per read).
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.5);
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
}

// A streaming client that goes away has its request aborted at once: the coordinator counts it
// as finish_reason "abort" well before its 2,000 tokens could have been generated.
TEST_F(OpenAiServerTest, ClientDisconnectAbortsItsRequest) {
  const double before = RequestsFinished(server_->Metrics(), "abort");
  {
    RawConnection c(port_);
    ASSERT_TRUE(c.connected());
    c.Send(PostKeepAlive("/v1/completions",
                         R"({"model": "tiny-deepseek-v3", "prompt": "Go", "max_tokens": 2000,
                             "ignore_eos": true, "temperature": 0, "stream": true})"));
    // The head and the first event, then away.
    const std::string seen = c.ReadUntil("data: {", 30s);
    ASSERT_NE(seen.find("data: {"), std::string::npos) << seen;
  }
  const auto t0 = std::chrono::steady_clock::now();
  double after = before;
  while (after <= before && std::chrono::steady_clock::now() - t0 < 10s) {
    std::this_thread::sleep_for(100ms);
    after = RequestsFinished(server_->Metrics(), "abort");
  }
  EXPECT_EQ(after, before + 1) << server_->Metrics();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
}

TEST_F(OpenAiServerTest, MissingKeyIs401) {
  const std::string r = RawHttp(port_, Post("/v1/completions", "{}", /*auth=*/false));
  EXPECT_EQ(StatusOf(r), 401) << r;
  EXPECT_EQ(BodyOf(r)["error"]["type"], "authentication_error");
}

// A front end whose coordinator is not there: /health and generation answer 503, not a hang.
TEST_F(OpenAiServerTest, CoordinatorDownIs503) {
  const auto log = std::filesystem::temp_directory_path() /
                   ("mlaserve-openai-down-" + std::to_string(getpid()) + ".log");
  const std::string cmd =
      std::string("exec ") + MLASERVE_OPENAI_BIN + " --coordinator ipc://" +
      (std::filesystem::temp_directory_path() / "mlaserve-no-coordinator").string() +
      " --listen 127.0.0.1:0 > " + log.string() + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int port = 0;
  for (int i = 0; i < 200 && port <= 0; ++i) {
    std::this_thread::sleep_for(50ms);
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    std::smatch m;
    if (std::regex_search(text, m, std::regex("listening on port ([0-9]+)")))
      port = std::stoi(m[1]);
  }
  ASSERT_GT(port, 0);
  const std::string h =
      RawHttp(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(h), 503) << h;
  const std::string g =
      RawHttp(port, Post("/v1/chat/completions",
                         R"({"model": "m", "messages": [{"role": "user", "content": "hi"}]})"));
  EXPECT_EQ(StatusOf(g), 503) << g;
  EXPECT_EQ(BodyOf(g)["error"]["code"], "coordinator_unavailable");
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
}

// Without --model the tokenizer endpoints say what is missing; tools are refused likewise.
TEST_F(OpenAiServerTest, WithoutModelFlagTokenizerFeaturesSaySo) {
  pid_t pid;
  const int port = StartFrontEnd("--coordinator " + server_->endpoint(), "nomodel", &pid);
  ASSERT_GT(port, 0);
  const std::string t = RawHttp(port, Post("/tokenize", R"({"prompt": "hi"})", false));
  EXPECT_EQ(StatusOf(t), 501) << t;
  EXPECT_NE(BodyOf(t)["error"]["message"].get<std::string>().find("--model"), std::string::npos);
  const std::string d = RawHttp(port, Post("/detokenize", R"({"tokens": [1]})", false));
  EXPECT_EQ(StatusOf(d), 501) << d;
  const std::string g = RawHttp(
      port, Post("/v1/chat/completions",
                 R"({"model": "tiny-deepseek-v3", "messages": [{"role": "user", "content": "hi"}],
                     "tools": [{"type": "function", "function": {"name": "f"}}]})",
                 false));
  EXPECT_EQ(StatusOf(g), 400) << g;
  EXPECT_EQ(BodyOf(g)["error"]["param"], "tools");
  const std::string v =
      RawHttp(port, "GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(v), 200) << v;
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
}

// --reasoning-parser deepseek: the output starts inside the thinking (R1 / V3.1 thinking put
// "<think>" in the prompt). The tiny model never writes "</think>" (it is not even one token of
// DeepSeek-V3's vocabulary, and the random weights do not spell it), so all of its greedy text is
// reasoning: reasoning_content must equal the plain front end's content, streamed or not.
TEST_F(OpenAiServerTest, DeepSeekReasoningParserMovesTheThinking) {
  pid_t pid;
  const int port = StartFrontEnd(std::string("--coordinator ") + server_->endpoint() + " --model " +
                                     MLASERVE_TINY_MODEL_DIR + " --reasoning-parser deepseek",
                                 "reasoning", &pid);
  ASSERT_GT(port, 0);
  const std::string models =
      RawHttp(port_, std::string("GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ") +
                         kApiKey + "\r\nConnection: close\r\n\r\n");
  const std::string model = BodyOf(models)["data"][0]["id"];
  const std::string req =
      R"({"model": ")" + model + R"(", "messages": [{"role": "user", "content": "Why?"}],
      "temperature": 0, "max_tokens": 12, "ignore_eos": true)";
  const std::string plain = RawHttp(port_, Post("/v1/chat/completions", req + "}"));
  ASSERT_EQ(StatusOf(plain), 200) << plain;
  const std::string text = BodyOf(plain)["choices"][0]["message"]["content"];
  ASSERT_FALSE(text.empty());
  ASSERT_EQ(text.find("</think>"), std::string::npos);
  const std::string split = RawHttp(port, Post("/v1/chat/completions", req + "}", false));
  ASSERT_EQ(StatusOf(split), 200) << split;
  const auto msg = BodyOf(split)["choices"][0]["message"];
  EXPECT_EQ(msg["content"], "");
  EXPECT_EQ(msg["reasoning_content"], text);
  EXPECT_EQ(msg["reasoning"], text);
  const std::string stream =
      RawHttp(port, Post("/v1/chat/completions", req + R"(, "stream": true})", false));
  std::string reasoning, content;
  int finishes = 0;
  std::istringstream lines(stream.substr(stream.find("\r\n\r\n") + 4));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const auto ev = nlohmann::json::parse(line.substr(6));
    for (const auto& c : ev["choices"]) {
      reasoning += c["delta"].value("reasoning_content", "");
      content += c["delta"].value("content", "");
      if (!c["finish_reason"].is_null()) ++finishes;
    }
  }
  EXPECT_EQ(reasoning, text);
  EXPECT_EQ(content, "");
  EXPECT_EQ(finishes, 1);
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
}

// The tiny model's tokenizer with DeepSeek-V3.1's chat template (thinking on / off through
// chat_template_kwargs), in a temporary folder for `mlaserve-openai --model`.
std::filesystem::path V31ModelDir(const std::string& tag) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("mlaserve-" + tag + "-" + std::to_string(getpid()));
  fs::create_directories(dir);
  fs::copy_file(fs::path(MLASERVE_TINY_MODEL_DIR) / "tokenizer.json", dir / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  std::ifstream config_in(fs::path(MLASERVE_TINY_MODEL_DIR) / "tokenizer_config.json");
  nlohmann::json config = nlohmann::json::parse(config_in);
  std::ifstream tmpl(std::string(std::getenv("MLASERVE_SOURCE_DIR")) +
                     "/tests/fixtures/chat-templates/deepseek-ai-DeepSeek-V3.1.jinja");
  config["chat_template"] = std::string((std::istreambuf_iterator<char>(tmpl)), {});
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  return dir;
}

// chat_template_kwargs reach the template. A front end whose model folder has DeepSeek-V3.1's
// template (tests/fixtures/chat-templates) and the tiny model's tokenizer renders the prompt and
// sends its token ids: {"thinking": true} ends it with "<think>", so the reasoning parser puts
// the output into reasoning_content; false ends it with "</think>" and the output is content.
// Oracles: the prompt's text is jinja2's rendering (chat_prompt_test checks that); the output is
// the coordinator's own text for those token ids through /v1/completions on the plain front end.
TEST_F(OpenAiServerTest, ChatTemplateKwargsTurnThinkingOnAndOff) {
  namespace fs = std::filesystem;
  const fs::path dir = V31ModelDir("v31");
  pid_t pid;
  const int port = StartFrontEnd("--coordinator " + server_->endpoint() + " --model " +
                                     dir.string() + " --reasoning-parser deepseek",
                                 "v31", &pid);
  ASSERT_GT(port, 0);
  const std::string messages = R"([{"role": "user", "content": "Why is the sky blue?"}])";
  for (const bool thinking : {true, false}) {
    SCOPED_TRACE(thinking ? "thinking on" : "thinking off");
    const std::string kwargs =
        std::string(R"({"thinking": )") + (thinking ? "true" : "false") + "}";
    const auto tok = BodyOf(
        RawHttp(port, Post("/tokenize", R"({"messages": )" + messages +
                                            R"(, "chat_template_kwargs": )" + kwargs + "}")));
    ASSERT_TRUE(tok.contains("tokens")) << tok;
    const auto text = BodyOf(RawHttp(
        port, Post("/detokenize", R"({"tokens": )" + tok["tokens"].dump() + "}")))["prompt"];
    EXPECT_EQ(text,
              std::string("<｜begin▁of▁sentence｜><｜User｜>Why is the sky blue?<｜Assistant｜>") +
                  (thinking ? "<think>" : "</think>"));
    const std::string params = R"(, "temperature": 0, "max_tokens": 12, "ignore_eos": true)";
    const auto plain = BodyOf(
        RawHttp(port_, Post("/v1/completions", R"({"model": "tiny-deepseek-v3", "prompt": )" +
                                                   tok["tokens"].dump() + params + "}")));
    const std::string want = plain["choices"][0]["text"];
    ASSERT_FALSE(want.empty()) << plain;
    const std::string chat = R"({"model": "tiny-deepseek-v3", "messages": )" + messages +
                             R"(, "chat_template_kwargs": )" + kwargs + params;
    const auto full = BodyOf(RawHttp(port, Post("/v1/chat/completions", chat + "}")));
    ASSERT_TRUE(full.contains("choices")) << full;
    const auto msg = full["choices"][0]["message"];
    EXPECT_EQ(full["usage"]["prompt_tokens"], tok["count"]);
    if (thinking) {
      EXPECT_EQ(msg["reasoning_content"], want);
      EXPECT_EQ(msg["content"], "");
    } else {
      EXPECT_EQ(msg["content"], want);
      EXPECT_FALSE(msg.contains("reasoning_content")) << msg;
    }
    std::string reasoning, content;
    for (const auto& e :
         Events(RawHttp(port, Post("/v1/chat/completions", chat + R"(, "stream": true})")))) {
      if (!e.is_object()) continue;
      for (const auto& c : e["choices"]) {
        reasoning += c["delta"].value("reasoning_content", "");
        content += c["delta"].value("content", "");
      }
    }
    EXPECT_EQ(thinking ? reasoning : content, want);
    EXPECT_EQ(thinking ? content : reasoning, "");
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  fs::remove_all(dir);
}

// Stop strings with a reasoning parser: matched in the front end on the answer's content (the
// coordinator sees tokens only): the content ends before the first stop string, finish_reason
// "stop", streamed or not; in the reasoning they end nothing. Oracle: the same greedy request
// without the stop strings.
TEST_F(OpenAiServerTest, StopStringsEndTheParsedAnswer) {
  namespace fs = std::filesystem;
  const fs::path dir = V31ModelDir("v31stop");
  pid_t pid;
  const int port = StartFrontEnd("--coordinator " + server_->endpoint() + " --model " +
                                     dir.string() + " --reasoning-parser deepseek",
                                 "v31stop", &pid);
  ASSERT_GT(port, 0);
  const std::string messages = R"([{"role": "user", "content": "Why is the sky blue?"}])";
  for (const bool thinking : {false, true}) {
    SCOPED_TRACE(thinking ? "thinking on" : "thinking off");
    const std::string chat = R"({"model": "tiny-deepseek-v3", "messages": )" + messages +
                             R"(, "chat_template_kwargs": {"thinking": )" +
                             (thinking ? "true" : "false") +
                             R"(}, "temperature": 0, "max_tokens": 16, "ignore_eos": true)";
    const auto plain = BodyOf(RawHttp(port, Post("/v1/chat/completions", chat + "}")));
    ASSERT_TRUE(plain.contains("choices")) << plain;
    const std::string want =
        plain["choices"][0]["message"][thinking ? "reasoning_content" : "content"];
    ASSERT_GE(want.size(), 8u) << plain;
    // A stop string from the middle of the output (two whole UTF-8 characters); the answer
    // must end at its first occurrence.
    auto boundary = [&](size_t i) {
      while (i < want.size() && (static_cast<unsigned char>(want[i]) & 0xC0) == 0x80) ++i;
      return i;
    };
    const size_t from = boundary(want.size() / 2);
    const std::string stop = want.substr(from, boundary(boundary(from + 1) + 1) - from);
    ASSERT_FALSE(stop.empty());
    const std::string with_stop = chat + R"(, "stop": [)" + nlohmann::json(stop).dump() + "]";
    const auto full = BodyOf(RawHttp(port, Post("/v1/chat/completions", with_stop + "}")));
    ASSERT_TRUE(full.contains("choices")) << full;
    const auto msg = full["choices"][0]["message"];
    std::string streamed, streamed_reasoning, finish;
    for (const auto& e : Events(
             RawHttp(port, Post("/v1/chat/completions", with_stop + R"(, "stream": true})")))) {
      if (!e.is_object()) continue;
      for (const auto& c : e["choices"]) {
        streamed += c["delta"].value("content", "");
        streamed_reasoning += c["delta"].value("reasoning_content", "");
        if (c["finish_reason"].is_string()) finish = c["finish_reason"];
      }
    }
    if (thinking) {  // the reasoning runs on, whole
      EXPECT_EQ(msg["reasoning_content"], want);
      EXPECT_EQ(full["choices"][0]["finish_reason"], "length");
      EXPECT_EQ(streamed_reasoning, want);
      EXPECT_EQ(finish, "length");
    } else {
      const std::string cut = want.substr(0, want.find(stop));
      EXPECT_EQ(msg["content"], cut);
      EXPECT_EQ(full["choices"][0]["finish_reason"], "stop");
      EXPECT_LE(full["usage"]["completion_tokens"].get<int>(), 16);
      EXPECT_EQ(full["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"]);
      EXPECT_EQ(streamed, cut);
      EXPECT_EQ(finish, "stop");
    }
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  fs::remove_all(dir);
}

TEST_F(OpenAiServerTest, OfficialNodeClient) {
  const std::string npm = std::string(std::getenv("MLASERVE_SOURCE_DIR")) + "/third_party/npm";
  ASSERT_TRUE(std::filesystem::exists(npm + "/node_modules/openai/package.json"))
      << "the openai npm package is missing: run scripts/install_npm_assets.sh";
  const std::string out = (std::filesystem::temp_directory_path() /
                           ("mlaserve-openai-node-" + std::to_string(getpid()) + ".log"))
                              .string();
  const std::string cmd = "OPENAI_BASE_URL=http://127.0.0.1:" + std::to_string(port_) +
                          "/v1 OPENAI_API_KEY=" + kApiKey + " MLASERVE_NPM_DIR=" + npm +
                          " MLASERVE_TINY_MODEL_DIR=" + MLASERVE_TINY_MODEL_DIR + " " +
                          MLASERVE_NODE + " " + std::getenv("MLASERVE_SOURCE_DIR") +
                          "/tests/openai/openai_client_test.mjs > " + out + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::printf("%s", text.c_str());
  EXPECT_EQ(rc, 0) << text << "\n--- mlaserve-openai\n" << Log() << server_->Logs();
}

// Servers of their own, taken down by the tests: overload (429), drain (503 "draining") and a
// failed worker job (503 "worker_failed" until a new job serves, then the coordinator gone:
// "coordinator_unavailable").
class OpenAiFailureTest : public ::testing::Test {
 protected:
  // A coordinator + 2 CPU workers with `coordinator_args`, and a front end before it.
  void Start(std::vector<std::string> coordinator_args) {
    ServerOptions o;
    o.model_dir = MLASERVE_TINY_MODEL_DIR;
    o.kv_blocks = 256;
    o.coordinator_args = std::move(coordinator_args);
    const std::string error = server_.Start(o);
    ASSERT_EQ(error, "");
    port_ = StartFrontEnd("--coordinator " + server_.endpoint() + " --api-key " + kApiKey +
                              " --model " + MLASERVE_TINY_MODEL_DIR,
                          "failure", &front_end_);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (front_end_ > 0) {
      kill(front_end_, SIGTERM);
      waitpid(front_end_, nullptr, 0);
    }
    server_.Kill();
  }
  // A stream of `max_tokens` tokens, open once its first event is in.
  std::unique_ptr<RawConnection> OpenStream(int max_tokens) {
    auto c = std::make_unique<RawConnection>(port_);
    c->Send(PostKeepAlive("/v1/chat/completions",
                          R"({"model": "tiny-deepseek-v3", "messages": [{"role": "user",
                              "content": "Go on"}], "stream": true, "ignore_eos": true,
                              "temperature": 0, "max_tokens": )" +
                              std::to_string(max_tokens) + "}"));
    const std::string seen = c->ReadUntil("data: {", 60s);
    EXPECT_NE(seen.find("data: {"), std::string::npos) << seen;
    return c;
  }
  // The error events of a stream read to its end, and whether it ended with [DONE].
  static std::vector<nlohmann::json> StreamErrors(RawConnection& c, bool* done) {
    const auto r = c.Read(60s);
    std::vector<nlohmann::json> errors;
    const auto events = Events(r.body);
    *done = !events.empty() && events.back() == "[DONE]";
    int finishes = 0;
    for (const auto& e : events) {
      if (e.is_object() && e.contains("error")) errors.push_back(e["error"]);
      if (e.is_object() && e.contains("choices")) {
        for (const auto& ch : e["choices"]) finishes += !ch["finish_reason"].is_null();
      }
    }
    EXPECT_EQ(finishes, 0) << r.body.substr(0, 2000);  // cut short: an error, not a finish
    return errors;
  }
  std::string Chat(const std::string& extra = "") {
    return R"({"model": "tiny-deepseek-v3", "messages": [{"role": "user", "content": "Hi"}],
               "max_tokens": 40, "ignore_eos": true)" +
           extra + "}";
  }

  ServerProcesses server_;
  pid_t front_end_ = -1;
  int port_ = 0;
};

TEST_F(OpenAiFailureTest, OverloadIs429AndDrainingIs503) {
  Start({"--max-running", "1", "--max-waiting", "1", "--drain-timeout-ms", "4000"});
  // One choice runs, one waits, the third finds the queue full: the request fails whole.
  const std::string over = RawHttp(port_, Post("/v1/chat/completions", Chat(R"(, "n": 4)")));
  EXPECT_EQ(StatusOf(over), 429) << over;
  EXPECT_EQ(BodyOf(over)["error"]["type"], "rate_limit_error");
  EXPECT_EQ(BodyOf(over)["error"]["code"], "overloaded");
  // Its choices were aborted: the next request runs (once the aborts, sent over another
  // connection to the coordinator, are in).
  std::string next;
  for (int i = 0; i < 20 && StatusOf(next) != 200; ++i) {
    if (i > 0) std::this_thread::sleep_for(100ms);
    next = RawHttp(port_, Post("/v1/chat/completions", Chat()));
  }
  EXPECT_EQ(StatusOf(next), 200) << next;

  auto stream = OpenStream(3000);
  std::thread stop([&] { server_.Stop(); });  // SIGTERM: drain, up to 4 s
  std::string health;
  for (int i = 0; i < 100 && StatusOf(health) != 503; ++i) {
    std::this_thread::sleep_for(50ms);
    health = RawHttp(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  }
  EXPECT_EQ(StatusOf(health), 503) << health;
  const std::string late = RawHttp(port_, Post("/v1/chat/completions", Chat()));
  EXPECT_EQ(StatusOf(late), 503) << late;
  EXPECT_EQ(BodyOf(late)["error"]["code"], "draining");
  // The stream in flight is aborted at the drain deadline: an error event, then [DONE].
  bool done = false;
  const auto errors = StreamErrors(*stream, &done);
  stop.join();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0]["code"], "draining");
  EXPECT_TRUE(done);
}

// The front end before a coordinator that requires CURVE (issue 24): with --server-key and
// --client-key (an allowed pair) it is served; without keys its requests get 503.
TEST(OpenAiCurveTest, FrontEndWithKeysIsServedByACurveCoordinator) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mlaserve-openai-curve-" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto server_pair = GenerateCurveKeyPair();
  auto client_pair = GenerateCurveKeyPair();
  ASSERT_TRUE(server_pair.ok() && client_pair.ok());
  ASSERT_TRUE(WriteCurveKeyFiles((dir / "server").string(), *server_pair, "server").ok());
  ASSERT_TRUE(WriteCurveKeyFiles((dir / "http").string(), *client_pair, "http front end").ok());
  {
    std::ifstream in(dir / "http.pub");
    std::ofstream(dir / "allowed") << in.rdbuf();
  }
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = MLASERVE_TINY_MODEL_DIR;
  o.kv_blocks = 64;
  o.coordinator_args = {"--curve-secret-key", (dir / "server.key").string(),
                        "--curve-allowed-clients", (dir / "allowed").string()};
  o.client_security = {(dir / "server.pub").string(), (dir / "http.key").string()};
  ASSERT_EQ(server.Start(o), "");
  pid_t with_keys = -1, without = -1;
  const int port = StartFrontEnd("--coordinator " + server.endpoint() + " --server-key " +
                                     (dir / "server.pub").string() + " --client-key " +
                                     (dir / "http.key").string(),
                                 "curve", &with_keys);
  ASSERT_GT(port, 0);
  const std::string chat = R"({"model": "tiny-deepseek-v3", "messages": [{"role": "user",
      "content": "Hi"}], "max_tokens": 5, "ignore_eos": true})";
  std::string ok;
  for (int i = 0; i < 100 && StatusOf(ok) != 200; ++i) {
    if (i > 0) std::this_thread::sleep_for(100ms);
    ok = RawHttp(port, Post("/v1/chat/completions", chat));
  }
  EXPECT_EQ(StatusOf(ok), 200) << ok;
  EXPECT_EQ(BodyOf(ok)["usage"]["completion_tokens"], 5) << ok;
  const int bare = StartFrontEnd("--coordinator " + server.endpoint(), "curve-bare", &without);
  ASSERT_GT(bare, 0);
  const std::string refused = RawHttp(bare, Post("/v1/chat/completions", chat));
  EXPECT_EQ(StatusOf(refused), 503) << refused;
  for (pid_t p : {with_keys, without}) {
    kill(p, SIGTERM);
    waitpid(p, nullptr, 0);
  }
  server.Kill();
  fs::remove_all(dir);
}

TEST_F(OpenAiFailureTest, FailedWorkerJobIs503UntilRestartedThenCoordinatorGoneIs503) {
  Start({});
  auto stream = OpenStream(3000);
  server_.KillWorkers();
  bool done = false;
  const auto errors = StreamErrors(*stream, &done);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0]["code"], "worker_failed") << errors[0];
  EXPECT_TRUE(done);
  // The coordinator stays up without workers: requests and /health are 503 worker_failed.
  const std::string next = RawHttp(port_, Post("/v1/chat/completions", Chat()));
  EXPECT_EQ(StatusOf(next), 503) << next;
  EXPECT_EQ(BodyOf(next)["error"]["code"], "worker_failed") << next;
  const std::string down =
      RawHttp(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(down), 503) << down;
  EXPECT_NE(down.find("worker job failed"), std::string::npos) << down;
  // A new worker job (as the launcher restarts it): served again through the same front end.
  server_.RestartWorkers();
  std::string up;
  for (int i = 0; i < 900 && StatusOf(up) != 200; ++i) {
    if (i > 0) std::this_thread::sleep_for(100ms);
    up = RawHttp(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  }
  EXPECT_EQ(StatusOf(up), 200) << up << server_.Logs();
  const std::string served = RawHttp(port_, Post("/v1/chat/completions", Chat()));
  EXPECT_EQ(StatusOf(served), 200) << served;
  EXPECT_EQ(server_.Stop(), 0) << server_.Logs();
  // With the coordinator gone a request is not left waiting for --request-timeout-s (600 s).
  const auto t0 = std::chrono::steady_clock::now();
  const std::string gone = RawHttp(port_, Post("/v1/chat/completions", Chat()));
  EXPECT_EQ(StatusOf(gone), 503) << gone;
  EXPECT_EQ(BodyOf(gone)["error"]["code"], "coordinator_unavailable") << gone;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  const std::string health =
      RawHttp(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(health), 503) << health;
}

}  // namespace
}  // namespace mlaserve
