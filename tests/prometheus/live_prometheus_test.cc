// A real Prometheus (the Debian `prometheus` package) scrapes a real replica and answers every
// query operators will run: deploy/mlaserve-launch starts the coordinator and `mpirun -np 2` CPU
// workers on the tiny model (loopback ports), Prometheus runs with deploy/prometheus/prometheus.yml
// (ports rewritten to the test's, 1 s scrape and rule evaluation) and the shipped alert rules, and
// a bounded load exercises every finish reason, a rejection, prefix-cache hits and preemptions.
// Then, through Prometheus's HTTP API: every scrape target is up; every rule loaded, is healthy
// and its query returns a series; every panel query of deploy/grafana/dashboards/*.json (Grafana
// variables substituted) returns at least one series, and every template variable has values.
// A query that returns nothing is a failure: an empty panel is what an operator would see.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/client/client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/process_group.h"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using json = nlohmann::json;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

// GET http://127.0.0.1:port/target; returns the body ("" if the connection failed), `status` the
// code.
std::string HttpGet(int port, const std::string& target, int* status = nullptr) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  std::string resp;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    (void)!write(fd, req.data(), req.size());
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, n);
  }
  close(fd);
  if (status) *status = resp.size() > 12 ? std::atoi(resp.c_str() + 9) : 0;
  const size_t body = resp.find("\r\n\r\n");
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

std::string Tool(const char* env, const char* name) {
  if (const char* p = std::getenv(env)) return p;
  for (const char* dir : {"/usr/bin", "/usr/local/bin", "/bin"}) {
    if (fs::exists(fs::path(dir) / name)) return (fs::path(dir) / name).string();
  }
  return "";
}

// Grafana's variables as this test sets them: the one model, all ranks, a window covering the load.
std::string SubstituteGrafanaVariables(std::string expr, const std::string& model) {
  const std::vector<std::pair<std::string, std::string>> vars = {
      {"$__rate_interval", "1m"}, {"$__interval", "15s"}, {"$__range", "5m"}, {"${model}", model},
      {"$model", model},          {"${rank}", ".*"},      {"$rank", ".*"}};
  for (const auto& [k, v] : vars) {
    for (size_t at; (at = expr.find(k)) != std::string::npos;) expr.replace(at, k.size(), v);
  }
  return expr;
}

class LivePrometheusTest : public ::testing::Test {
 protected:
  // Runs an instant query; returns the result array (empty on error, with `error` set).
  json Query(const std::string& expr, std::string* error) {
    int status = 0;
    const std::string body = HttpGet(prom_port_, "/api/v1/query?query=" + UrlEncode(expr), &status);
    json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || j.value("status", "") != "success") {
      *error = "HTTP " + std::to_string(status) + ": " + body;
      return json::array();
    }
    const json& data = j["data"];
    if (data["resultType"] == "scalar" || data["resultType"] == "string")
      return json::array({data["result"]});
    return data["result"];
  }
  json Api(const std::string& path) {
    json j = json::parse(HttpGet(prom_port_, path), nullptr, false);
    return j.is_discarded() ? json() : j;
  }

  int prom_port_ = 0;
};

TEST_F(LivePrometheusTest, EveryTargetUpAndEveryDashboardAndRuleQueryReturnsSeries) {
  const char* ci = std::getenv("CI");
  const bool in_ci = ci != nullptr && std::string(ci) == "true";
  const std::string prometheus = Tool("MLASERVE_PROMETHEUS", "prometheus");
  const std::string promtool = Tool("MLASERVE_PROMTOOL", "promtool");
  if (prometheus.empty() || promtool.empty()) {
    if (in_ci)
      FAIL() << "prometheus/promtool not found: CI must install the Debian package `prometheus` "
                "(scripts/install_deps.sh)";
    GTEST_SKIP() << "prometheus/promtool not installed (apt-get install prometheus)";
  }
  ASSERT_NE(std::getenv("MLASERVE_SOURCE_DIR"), nullptr);
  const fs::path src = std::getenv("MLASERVE_SOURCE_DIR");
  const fs::path bin = std::getenv("MLASERVE_BINARY_DIR");
  const fs::path rules = src / "deploy/prometheus/mlaserve-rules.yml";
  const fs::path dir =
      fs::temp_directory_path() / ("mlaserve-prom-test-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  struct Cleanup {
    fs::path d;
    ~Cleanup() {
      if (!::testing::Test::HasFailure()) fs::remove_all(d);
    }
  } cleanup{dir};

  // The rules as shipped pass promtool.
  {
    const std::string cmd = promtool + " check rules " + rules.string() + " > " +
                            (dir / "promtool.log").string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(dir / "promtool.log");
  }

  std::srand(static_cast<unsigned>(getpid()));
  std::set<int> taken;
  const int client_port = FreePorts(1, taken), worker_port = FreePorts(1, taken),
            coord_metrics = FreePorts(1, taken);
  const int worker_metrics = FreePorts(2, taken);
  prom_port_ = FreePorts(1, taken);
  ASSERT_TRUE(client_port && worker_port && coord_metrics && worker_metrics && prom_port_);

  // Prometheus config: the shipped one with the test's ports, a 1 s scrape and the rules' full
  // path.
  std::string cfg = ReadFile(src / "deploy/prometheus/prometheus.yml");
  auto rewrite = [&](const std::string& pattern, const std::string& with) {
    const std::string before = cfg;
    cfg = std::regex_replace(cfg, std::regex(pattern), with);
    return cfg != before;
  };
  ASSERT_TRUE(rewrite("scrape_interval: \\S+", "scrape_interval: 1s"));
  ASSERT_TRUE(rewrite("evaluation_interval: \\S+", "evaluation_interval: 1s"));
  ASSERT_TRUE(rewrite("- mlaserve-rules\\.yml", "- " + rules.string()));
  ASSERT_TRUE(rewrite("'localhost:9400'", "'127.0.0.1:" + std::to_string(coord_metrics) + "'"));
  ASSERT_TRUE(rewrite("\\['localhost:9410'[^\\]]*\\]",
                      "['127.0.0.1:" + std::to_string(worker_metrics) +
                          "', '127.0.0.1:" + std::to_string(worker_metrics + 1) + "']"));
  std::ofstream(dir / "prometheus.yml") << cfg;
  {
    const std::string cmd = promtool + " check config " + (dir / "prometheus.yml").string() +
                            " > " + (dir / "promtool.log").string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(dir / "promtool.log") << cfg;
  }

  // The replica, through the shipped launcher. KV pool of 8 blocks (512 tokens) forces preemption.
  const std::string model = MLASERVE_TINY_MODEL_DIR;
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(client_port);
  Group launcher;
  launcher.pid = Spawn({"/bin/bash",
                        (src / "deploy/mlaserve-launch").string(),
                        "--model",
                        model,
                        "--cpu",
                        "--ranks",
                        "2",
                        "--bin",
                        bin.string(),
                        "--listen",
                        endpoint,
                        "--worker-port",
                        std::to_string(worker_port),
                        "--worker-bind",
                        "127.0.0.1",
                        "--metrics",
                        "127.0.0.1:" + std::to_string(coord_metrics),
                        "--worker-metrics-port",
                        std::to_string(worker_metrics),
                        "--worker-metrics-host",
                        "127.0.0.1",
                        "--kv-blocks",
                        "8",
                        "--",
                        "--worker-start-timeout-ms",
                        "60000",
                        "--max-step-tokens",
                        "512"},
                       (dir / "launch.log").string());
  ASSERT_GT(launcher.pid, 0);
  Group prom;
  prom.pid =
      Spawn({prometheus, "--config.file=" + (dir / "prometheus.yml").string(),
             "--storage.tsdb.path=" + (dir / "data").string(),
             "--web.listen-address=127.0.0.1:" + std::to_string(prom_port_), "--log.level=warn"},
            (dir / "prometheus.log").string());
  ASSERT_GT(prom.pid, 0);
  const std::string model_name = fs::path(model).filename().string();

  auto client = Client::Connect(endpoint);
  ASSERT_TRUE(client.ok()) << client.status();
  Client& c = **client;
  {
    bool healthy = false;
    for (auto deadline = std::chrono::steady_clock::now() + 90s;
         !healthy && std::chrono::steady_clock::now() < deadline;) {
      auto h = c.Health(500ms);
      healthy = h.ok() && h->ok;
      ASSERT_EQ(WaitFor(launcher.pid, 0ms), -1) << "launcher exited\n"
                                                << ReadFile((dir / "launch.log").string());
    }
    ASSERT_TRUE(healthy) << ReadFile((dir / "launch.log").string());
    int status = 0;
    for (int i = 0; i < 100 && status != 200; ++i, std::this_thread::sleep_for(100ms))
      HttpGet(prom_port_, "/-/ready", &status);
    ASSERT_EQ(status, 200) << ReadFile((dir / "prometheus.log").string());
  }

  // Bounded load. Finish reasons: length (max_tokens), stop (a token the greedy run is known to
  // produce, as a stop token), abort; a rejection (temperature -1: invalidRequest). Twelve requests
  // share one ~100-token prompt: prefix-cache hits, and 12 x 3 blocks > 8 blocks: preemptions.
  std::string prompt;
  for (int i = 0; i < 8; ++i)
    prompt += "Operators watch mlaserve in Grafana while it serves requests. ";
  auto input = [&](uint32_t max_tokens) {
    GenerateInput in;
    in.text = prompt;
    in.sampling.max_tokens = max_tokens;
    in.sampling.ignore_eos = true;
    return in;
  };
  auto greedy = c.Generate(
      input(6), [](const Reply&) {}, 60s);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  ASSERT_EQ(greedy->finish_reason, "length");
  ASSERT_GE(greedy->token_ids.size(), 3u);
  std::map<uint64_t, std::string> pending;  // id -> what it tests
  {
    GenerateInput in = input(40);
    in.sampling.stop_token_ids = {greedy->token_ids[2]};
    auto id = c.Submit(in);
    ASSERT_TRUE(id.ok());
    pending[*id] = "stop";
  }
  for (int i = 0; i < 12; ++i) {
    GenerateInput in = input(48);
    in.sampling.temperature = 0.8f;
    in.sampling.seed = i;
    auto id = c.Submit(in);
    ASSERT_TRUE(id.ok());
    pending[*id] = "length";
  }
  {
    auto id = c.Submit(input(400));
    ASSERT_TRUE(id.ok());
    pending[*id] = "abort";
    ASSERT_TRUE(c.Abort(*id).ok());
    GenerateInput bad = input(4);
    bad.sampling.temperature = -1.0f;
    auto bad_id = c.Submit(bad);
    ASSERT_TRUE(bad_id.ok());
    pending[*bad_id] = "rejected";
  }
  std::map<std::string, int> outcomes;
  const auto load_start = std::chrono::steady_clock::now();
  while (!pending.empty()) {
    auto r = c.Next(120s);
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << ReadFile((dir / "launch.log").string());
    if (r->kind == Reply::Kind::kChunk) continue;
    auto it = pending.find(r->request_id);
    if (it == pending.end()) continue;
    const std::string got = r->kind == Reply::Kind::kError ? "rejected" : r->finish_reason;
    EXPECT_EQ(got, it->second) << "request " << r->request_id << ": " << r->message;
    ++outcomes[got];
    pending.erase(it);
  }
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  std::printf("load: %d length, %d stop, %d abort, %d rejected in %.1f s\n", outcomes["length"],
              outcomes["stop"], outcomes["abort"], outcomes["rejected"], load_s);

  // Prometheus has the load once a scrape shows the abort; two more intervals let the rules run.
  std::string err;
  bool scraped = false;
  for (int i = 0; i < 100 && !scraped; ++i, std::this_thread::sleep_for(200ms)) {
    scraped = !Query("mlaserve_requests_total{finish_reason=\"abort\"} > 0", &err).empty();
  }
  ASSERT_TRUE(scraped) << err << ReadFile((dir / "prometheus.log").string());
  std::this_thread::sleep_for(2500ms);

  // The load did exercise what the panels show (through Prometheus, not the exporter).
  for (const char* must :
       {"mlaserve_requests_total{finish_reason=\"stop\"} > 0",
        "mlaserve_requests_rejected_total{code=\"invalidRequest\"} > 0",
        "mlaserve_prefix_cache_hits_total > 0", "mlaserve_preemptions_total > 0",
        "mlaserve_worker_steps_total > 0", "mlaserve_worker_comm_seconds_total > 0",
        "mlaserve_worker_memory_bytes{kind=\"kv_cache\"} > 0"}) {
    EXPECT_FALSE(Query(must, &err).empty()) << must << " is empty " << err;
  }

  // Every target up.
  {
    json t = Api("/api/v1/targets");
    ASSERT_TRUE(t.contains("data")) << t.dump();
    int up = 0, total = 0;
    std::set<std::string> jobs;
    for (const json& target : t["data"]["activeTargets"]) {
      ++total;
      jobs.insert(target["labels"]["job"].get<std::string>());
      if (target["health"] == "up")
        ++up;
      else
        ADD_FAILURE() << "target " << target.dump() << " is not up";
    }
    EXPECT_EQ(total, 3);
    EXPECT_EQ(jobs, (std::set<std::string>{"mlaserve-coordinator", "mlaserve-worker"}));
    std::printf("targets up: %d of %d\n", up, total);
  }

  // Every rule loaded and healthy; every rule's query returns a series. Alerts follow the
  // convention "<query> <op> <number>" and are evaluated as "<query> <op> bool <number>", which
  // returns the series whether or not the alert would fire.
  {
    const std::string text = ReadFile(rules);
    const std::regex rule_line("\\n\\s*- (alert|record):");
    const auto shipped = std::distance(std::sregex_iterator(text.begin(), text.end(), rule_line),
                                       std::sregex_iterator());
    json r = Api("/api/v1/rules");
    ASSERT_TRUE(r.contains("data")) << r.dump();
    int loaded = 0, evaluated = 0;
    const std::regex cmp("^([\\s\\S]*\\S)\\s*(==|!=|>=|<=|>|<)\\s*(-?[0-9.eE+]+)\\s*$");
    for (const json& g : r["data"]["groups"]) {
      for (const json& rule : g["rules"]) {
        ++loaded;
        const std::string name = rule["name"], query = rule["query"];
        EXPECT_EQ(rule["health"], "ok") << name << ": " << rule.dump();
        std::string q = query;
        if (rule["type"] == "alerting") {
          std::smatch m;
          if (!std::regex_match(query, m, cmp)) {
            ADD_FAILURE() << name << ": alert expression is not '<query> <op> <number>': " << query;
            continue;
          }
          q = m[1].str() + " " + m[2].str() + " bool " + m[3].str();
        }
        const json res = Query(q, &err);
        if (res.empty())
          ADD_FAILURE() << "rule " << name << ": " << q << " returned no series " << err;
        else
          ++evaluated;
      }
    }
    EXPECT_EQ(loaded, shipped) << "rules in " << rules << " that Prometheus did not load";
    std::printf("rules: %d loaded of %ld shipped, %d queries return series\n", loaded,
                static_cast<long>(shipped), evaluated);
  }

  // Every dashboard panel's every query returns a series; every template variable has values.
  int panels = 0, queries = 0, returned = 0, finite = 0, variables = 0;
  for (const auto& entry : fs::directory_iterator(src / "deploy/grafana/dashboards")) {
    if (entry.path().extension() != ".json") continue;
    const json d = json::parse(ReadFile(entry.path()), nullptr, false);
    ASSERT_FALSE(d.is_discarded()) << entry.path() << " is not JSON";
    const std::string board = entry.path().filename().string();
    for (const json& v : d["templating"]["list"]) {
      if (v["type"] != "query") continue;
      const std::string def =
          SubstituteGrafanaVariables(v["definition"].get<std::string>(), model_name);
      std::smatch m;
      ASSERT_TRUE(std::regex_match(def, m, std::regex("label_values\\((.+), *(\\w+)\\)")))
          << board << ": " << def;
      json vals = Api("/api/v1/label/" + m[2].str() + "/values?match[]=" + UrlEncode(m[1].str()));
      ++variables;
      EXPECT_FALSE(vals["data"].empty())
          << board << " variable " << v["name"] << ": " << def << " has no values";
      if (v["name"] == "model") EXPECT_EQ(vals["data"], json::array({model_name})) << vals.dump();
      if (v["name"] == "rank") EXPECT_EQ(vals["data"], json::array({"0", "1"})) << vals.dump();
    }
    std::vector<json> stack(d["panels"].begin(), d["panels"].end());
    while (!stack.empty()) {
      json p = stack.back();
      stack.pop_back();
      if (p["type"] == "row") {
        for (const json& child : p.value("panels", json::array())) stack.push_back(child);
        continue;
      }
      ++panels;
      const std::string title = board + " / " + p.value("title", "?");
      if (p.value("targets", json::array()).empty()) ADD_FAILURE() << title << " has no query";
      for (const json& t : p.value("targets", json::array())) {
        ++queries;
        const std::string q = SubstituteGrafanaVariables(t.value("expr", ""), model_name);
        if (q.find('$') != std::string::npos) {
          ADD_FAILURE() << title << ": unknown Grafana variable in " << q;
          continue;
        }
        const json res = Query(q, &err);
        if (res.empty()) {
          ADD_FAILURE() << title << " [" << t.value("refId", "") << "]: " << q
                        << " returned no series " << err;
          continue;
        }
        ++returned;
        bool any_finite = false;
        for (const json& s : res) {
          const json& value = s.contains("value") ? s["value"] : s;
          if (value.is_array() && value.size() == 2 &&
              std::isfinite(std::stod(value[1].get<std::string>())))
            any_finite = true;
        }
        finite += any_finite;
      }
    }
  }
  EXPECT_GT(panels, 20);
  std::printf(
      "dashboards: %d panels, %d queries, %d return series (%d with a finite value), %d "
      "variables\n",
      panels, queries, returned, finite, variables);

  // SIGTERM drains and stops cleanly.
  EXPECT_EQ(launcher.Stop(60s), 0) << ReadFile((dir / "launch.log").string());
  EXPECT_EQ(prom.Stop(20s), 0) << ReadFile((dir / "prometheus.log").string());
}

}  // namespace
}  // namespace mlaserve
