// mlaserve-loadgen: load generator over the ZeroMQ API, or over the OpenAI HTTP API (--http).
//
//   mlaserve-loadgen --endpoint tcp://127.0.0.1:5555 --requests 200
//       (--concurrency N | --rate R)  [--input-len 512] [--output-len 128] [--vocab V]
//       [--input-file FILE] [--range 0.0] [--seed 1] [--metrics 127.0.0.1:9400]
//   mlaserve-loadgen --http 127.0.0.1:8000 [--api-key KEY] --concurrency N --requests 200 ...
//
// --http: streaming POST /v1/completions to mlaserve-openai with the same token-id prompts
// (http_load.h), N streams in flight over kept-alive connections; TTFT, ITL and E2E from the SSE
// events, TPOT from the usage chunk's token count; also the most streams open at once.
//
// Requests are random token ids (input and output lengths fixed, or varied uniformly by
// +-range), or lines of --input-file with "INPUT_LEN OUTPUT_LEN". --concurrency keeps N requests
// in flight; --rate sends a Poisson stream of R requests/s. Prints TTFT, TPOT, ITL and E2E
// (mean, p50, p90, p99), request and token throughput, and with --metrics the coordinator's
// overhead per step from its own histogram (scheduling + plan encoding + result handling).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "bench/loadgen/http_load.h"
#include "common/command_line.h"
#include "coordinator/client/client.h"

ABSL_FLAG(std::string, endpoint, "tcp://127.0.0.1:5555",
          "The coordinator's client endpoint (ZeroMQ mode).");
ABSL_FLAG(std::string, http, "",
          "HOST:PORT of mlaserve-openai: streaming POST /v1/completions instead of ZeroMQ (needs "
          "--concurrency).");
ABSL_FLAG(std::string, api_key, "", "--http: the front end's API key.");
ABSL_FLAG(int32_t, requests, 100, "Requests to send, in [1, 100000000].");
ABSL_FLAG(int32_t, concurrency, 0,
          "Keep N requests in flight, N in [0, 1000000] (give this or --rate).");
ABSL_FLAG(double, rate, 0,
          "A Poisson stream of R requests/s, R in [0, 1e9] (give this or --concurrency).");
ABSL_FLAG(int32_t, input_len, 512, "Prompt tokens per request, in [1, 16777216].");
ABSL_FLAG(int32_t, output_len, 128, "Output tokens per request, in [1, 16777216].");
ABSL_FLAG(int32_t, vocab, 32000, "Prompt token ids are drawn from [0, V), V in [1, 16777216].");
ABSL_FLAG(double, range, 0, "Lengths vary uniformly by +-this fraction, in [0, 1).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the prompts and lengths.");
ABSL_FLAG(std::string, input_file, "",
          "Lines \"INPUT_LEN OUTPUT_LEN\", one a request (instead of --input-len, --output-len).");
ABSL_FLAG(std::string, metrics, "",
          "HOST:PORT of the coordinator's /metrics: also print its overhead per step.");

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  std::vector<double> v;
  void Add(double x) { v.push_back(x); }
  double Mean() const {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0 : s / v.size();
  }
  double Pct(double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(std::ceil(p / 100.0 * v.size())) - (p > 0 ? 1 : 0))];
  }
  void Print(const char* name, double scale, const char* unit) {
    std::printf("%-6s mean %9.3f  p50 %9.3f  p90 %9.3f  p99 %9.3f %s (n=%zu)\n", name, Mean() * scale,
                Pct(50) * scale, Pct(90) * scale, Pct(99) * scale, unit, v.size());
  }
};

std::string HttpGet(const std::string& hostport, const std::string& path) {
  const auto colon = hostport.rfind(':');
  const std::string host = hostport.substr(0, colon);
  const int port = std::stoi(hostport.substr(colon + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\n\r\n";
    (void)!write(fd, req.data(), req.size());
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  }
  close(fd);
  return out;
}

// (sum, count) of a histogram in the coordinator's metrics text.
std::pair<double, double> Histogram(const std::string& text, const std::string& name) {
  std::smatch m;
  double sum = 0, count = 0;
  if (std::regex_search(text, m, std::regex(name + "_sum\\{[^}]*\\} ([0-9.eE+-]+)"))) sum = std::stod(m[1]);
  if (std::regex_search(text, m, std::regex(name + "_count\\{[^}]*\\} ([0-9.eE+-]+)"))) count = std::stod(m[1]);
  return {sum, count};
}

// The coordinator's own overhead per step and its step round trip between two metrics texts.
void PrintOverhead(const std::string& before, const std::string& after) {
  const auto b = Histogram(before, "mlaserve_coordinator_step_overhead_seconds");
  const auto a = Histogram(after, "mlaserve_coordinator_step_overhead_seconds");
  const auto sb = Histogram(before, "mlaserve_step_seconds");
  const auto sa = Histogram(after, "mlaserve_step_seconds");
  if (a.second > b.second) {
    std::printf("coordinator overhead per step (scheduling + plan encoding + result handling): %.1f us over %.0f steps; "
                "step round trip %.2f ms\n", (a.first - b.first) / (a.second - b.second) * 1e6, a.second - b.second,
                (sa.first - sb.first) / std::max(1.0, sa.second - sb.second) * 1e3);
  }
}

// CPU seconds this process has used (user + system).
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  ParseFlags(
      argc, argv,
      "mlaserve-loadgen (--endpoint E | --http HOST:PORT) (--concurrency N | --rate R) [flags]");
  const std::string endpoint = absl::GetFlag(FLAGS_endpoint),
                    input_file = absl::GetFlag(FLAGS_input_file);
  const std::string metrics = absl::GetFlag(FLAGS_metrics), http = absl::GetFlag(FLAGS_http);
  const std::string api_key = absl::GetFlag(FLAGS_api_key);
  const int requests = FlagInRange(FLAGS_requests, 1, 100000000);
  const int concurrency = FlagInRange(FLAGS_concurrency, 0, 1000000);
  const double rate = FlagInRange(FLAGS_rate, 0, 1e9);
  const int input_len = FlagInRange(FLAGS_input_len, 1, 1 << 24);
  const int output_len = FlagInRange(FLAGS_output_len, 1, 1 << 24);
  const int vocab = FlagInRange(FLAGS_vocab, 1, 1 << 24);
  const double range = absl::GetFlag(FLAGS_range);
  if (!(range >= 0 && range < 1))
    UsageError(absl::StrCat("--range ", range, ": must be in [0, 1)"));
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  if ((concurrency > 0) == (rate > 0))
    UsageError("give exactly one of --concurrency N and --rate R");
  int http_port = 0;
  if (!http.empty() &&
      !(absl::SimpleAtoi(http.substr(http.rfind(':') + 1), &http_port) &&
        http.rfind(':') != std::string::npos && http_port > 0 && http_port < 65536)) {
    UsageError("--http " + http + ": expected HOST:PORT");
  }
  if (!http.empty() && concurrency <= 0) UsageError("--http takes --concurrency N (no --rate)");
  std::mt19937_64 rng(seed);
  std::vector<std::pair<int, int>> shapes;
  if (!input_file.empty()) {
    std::ifstream in(input_file);
    int a, b;
    while (in >> a >> b) shapes.emplace_back(a, b);
    if (shapes.empty()) {
      std::fprintf(stderr, "mlaserve-loadgen: no \"INPUT OUTPUT\" lines in %s\n", input_file.c_str());
      return 2;
    }
  }
  auto shape = [&](int i) -> std::pair<int, int> {
    if (!shapes.empty()) return shapes[i % shapes.size()];
    std::uniform_real_distribution<double> u(1 - range, 1 + range);
    return {std::max(1, static_cast<int>(input_len * u(rng))), std::max(1, static_cast<int>(output_len * u(rng)))};
  };
  const double cpu0 = CpuSeconds();
  if (!http.empty()) {
    bench::HttpLoadOptions o;
    o.host = http.substr(0, http.rfind(':'));
    o.port = http_port;
    o.api_key = api_key;
    o.concurrency = concurrency;
    std::vector<bench::HttpRequestSpec> specs(static_cast<size_t>(requests));
    int64_t prompt_tokens = 0;
    std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
    for (int i = 0; i < requests; ++i) {
      const auto [in_len, out_len] = shape(i);
      specs[i].prompt.resize(static_cast<size_t>(in_len));
      for (auto& t : specs[i].prompt) t = tok(rng);
      specs[i].max_tokens = out_len;
      prompt_tokens += in_len;
    }
    const std::string before = metrics.empty() ? "" : HttpGet(metrics, "/metrics");
    bench::HttpLoadReport rep = bench::RunHttpLoad(o, specs);
    if (!rep.error.empty()) {
      std::fprintf(stderr, "mlaserve-loadgen: %s\n", rep.error.c_str());
      return 1;
    }
    Stats ttft, tpot, itl, e2e;
    int errors = 0;
    int64_t output_tokens = 0, events = 0;
    for (const bench::HttpRequestResult& r : rep.results) {
      if (!r.error.empty()) {
        if (errors++ < 3) std::fprintf(stderr, "mlaserve-loadgen: request failed: %s\n", r.error.c_str());
        continue;
      }
      ttft.Add(std::chrono::duration<double>(r.first - r.sent).count());
      for (double g : r.gaps) itl.Add(g);
      e2e.Add(std::chrono::duration<double>(r.last - r.sent).count());
      if (r.tokens > 1) tpot.Add(std::chrono::duration<double>(r.last - r.first).count() / (r.tokens - 1));
      output_tokens += r.tokens;
      events += r.events;
    }
    const double wall = rep.wall_seconds;
    std::printf("requests %d (errors %d) in %.2f s: %.2f req/s, input %.1f tok/s, output %.1f tok/s\n", requests,
                errors, wall, requests / wall, prompt_tokens / wall, output_tokens / wall);
    std::printf("http: peak open streams %d; %.3f SSE token events per token; loadgen CPU %.2f s (%.2f us/token)\n",
                rep.peak_open_streams, output_tokens > 0 ? static_cast<double>(events) / output_tokens : 0.0,
                CpuSeconds() - cpu0, output_tokens > 0 ? (CpuSeconds() - cpu0) / output_tokens * 1e6 : 0.0);
    ttft.Print("TTFT", 1e3, "ms");
    tpot.Print("TPOT", 1e3, "ms");
    itl.Print("ITL", 1e3, "ms");
    e2e.Print("E2E", 1e3, "ms");
    if (!metrics.empty()) PrintOverhead(before, HttpGet(metrics, "/metrics"));
    return errors == 0 ? 0 : 1;
  }
  auto client = Client::Connect(endpoint);
  if (!client.ok()) {
    std::fprintf(stderr, "mlaserve-loadgen: %s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  const std::string before = metrics.empty() ? "" : HttpGet(metrics, "/metrics");
  struct InFlight {
    Clock::time_point sent, first, last;
    bool has_first = false;
    int tokens = 0;
  };
  std::map<uint64_t, InFlight> flight;
  Stats ttft, tpot, itl, e2e;
  int sent = 0, done = 0, errors = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
  std::exponential_distribution<double> gap(rate > 0 ? rate : 1.0);
  const auto t0 = Clock::now();
  auto next_send = t0;
  auto send_one = [&]() {
    const auto [in_len, out_len] = shape(sent);
    GenerateInput in;
    std::vector<int32_t> ids(in_len);
    std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
    for (auto& t : ids) t = tok(rng);
    in.token_ids = std::move(ids);
    in.sampling.max_tokens = out_len;
    in.sampling.ignore_eos = true;
    auto id = (*client)->Submit(in);
    if (!id.ok()) {
      ++errors;
      ++done;
    } else {
      flight[*id] = {Clock::now(), {}, {}, false, 0};
    }
    prompt_tokens += in_len;
    ++sent;
  };
  while (done < requests) {
    if (concurrency > 0) {
      while (sent < requests && static_cast<int>(flight.size()) < concurrency) send_one();
    } else {
      while (sent < requests && Clock::now() >= next_send) {
        send_one();
        next_send += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
      }
    }
    const auto wait = concurrency > 0 || sent >= requests
                          ? std::chrono::milliseconds(60000)
                          : std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(next_send - Clock::now()));
    auto r = (*client)->Next(std::max(wait, std::chrono::milliseconds(1)));
    if (!r.ok()) {
      if (r.status().code() == absl::StatusCode::kDeadlineExceeded && concurrency == 0 && sent < requests) continue;
      std::fprintf(stderr, "mlaserve-loadgen: %s\n", std::string(r.status().message()).c_str());
      return 1;
    }
    auto it = flight.find(r->request_id);
    if (it == flight.end()) continue;
    const auto now = Clock::now();
    InFlight& f = it->second;
    if (r->kind == Reply::Kind::kChunk && !r->token_ids.empty()) {
      if (!f.has_first) {
        f.has_first = true;
        f.first = now;
        ttft.Add(std::chrono::duration<double>(now - f.sent).count());
      } else {
        itl.Add(std::chrono::duration<double>(now - f.last).count());
      }
      f.last = now;
      f.tokens += static_cast<int>(r->token_ids.size());
    } else if (r->kind == Reply::Kind::kFinal || r->kind == Reply::Kind::kError) {
      if (r->kind == Reply::Kind::kError || r->finish_reason == "error") ++errors;
      e2e.Add(std::chrono::duration<double>(now - f.sent).count());
      if (f.tokens > 1) tpot.Add(std::chrono::duration<double>(f.last - f.first).count() / (f.tokens - 1));
      output_tokens += f.tokens;
      flight.erase(it);
      ++done;
    }
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("requests %d (errors %d) in %.2f s: %.2f req/s, input %.1f tok/s, output %.1f tok/s\n", requests,
              errors, wall, requests / wall, prompt_tokens / wall, output_tokens / wall);
  ttft.Print("TTFT", 1e3, "ms");
  tpot.Print("TPOT", 1e3, "ms");
  itl.Print("ITL", 1e3, "ms");
  e2e.Print("E2E", 1e3, "ms");
  std::printf("loadgen CPU %.2f s (%.2f us/token)\n", CpuSeconds() - cpu0,
              output_tokens > 0 ? (CpuSeconds() - cpu0) / output_tokens * 1e6 : 0.0);
  if (!metrics.empty()) PrintOverhead(before, HttpGet(metrics, "/metrics"));
  return errors == 0 ? 0 : 1;
}
