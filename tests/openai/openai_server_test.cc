// mlaserve-openai end to end: a coordinator + `mpirun -np 2` CPU workers on the embedded tiny
// model (DeepSeek-V3's real tokenizer and chat template) behind mlaserve-openai with an API key.
// The official `openai` npm client runs openai_client_test.mjs against it; raw sockets check
// what that client cannot send (malformed JSON, an unknown route, an oversized body).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

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
  for (int i = 0; i < 200; ++i) {
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

TEST_F(OpenAiServerTest, BodyOverLimitIs413) {
  // Announces 9 MiB and sends none of it: refused from the header alone.
  const std::string r = RawHttp(port_, std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\n") +
                                           "Authorization: Bearer " + kApiKey + "\r\n" +
                                           "Content-Length: 9437184\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(StatusOf(r), 413) << r;
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

TEST_F(OpenAiServerTest, OfficialNodeClient) {
  const std::string npm = std::string(std::getenv("MLASERVE_SOURCE_DIR")) + "/third_party/npm";
  ASSERT_TRUE(std::filesystem::exists(npm + "/node_modules/openai/package.json"))
      << "the openai npm package is missing: run scripts/install_npm_assets.sh";
  const std::string out = (std::filesystem::temp_directory_path() /
                           ("mlaserve-openai-node-" + std::to_string(getpid()) + ".log"))
                              .string();
  const std::string cmd = "OPENAI_BASE_URL=http://127.0.0.1:" + std::to_string(port_) +
                          "/v1 OPENAI_API_KEY=" + kApiKey + " MLASERVE_NPM_DIR=" + npm + " " +
                          MLASERVE_NODE + " " + std::getenv("MLASERVE_SOURCE_DIR") +
                          "/tests/openai/openai_client_test.mjs > " + out + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::printf("%s", text.c_str());
  EXPECT_EQ(rc, 0) << text << "\n--- mlaserve-openai\n" << Log() << server_->Logs();
}

}  // namespace
}  // namespace mlaserve
