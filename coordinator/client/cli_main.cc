// mlaserve-cli: talk to a running coordinator, or make CURVE keys for talking to one.
//
//   mlaserve-cli [--endpoint tcp://127.0.0.1:5555] [--server-key FILE --client-key FILE] health
//   mlaserve-cli [--endpoint ...] info
//   mlaserve-cli [--endpoint ...] generate [options] "prompt text"     (raw text, streamed)
//   mlaserve-cli [--endpoint ...] generate [options] --ids 1,2,3
//   mlaserve-cli [--endpoint ...] chat [options] [--system "..."] "user message"  (chat template)
// options: --max-tokens N --temperature T --top-p P --top-k K --min-p P --seed S --stop STR
//          --ignore-eos --logprobs N --priority P --json (print the final reply as JSON)
//   mlaserve-cli keygen PREFIX [--label NAME]   writes PREFIX.key (key pair, mode 0600) and
//                                               PREFIX.pub (public key, 0644); never overwrites
// --server-key is the coordinator's .pub file, --client-key this client's .key file (its .pub
// must be in the server's --curve-allowed-clients); coordinator/auth/curve_keys.h: the format.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "coordinator/auth/curve_keys.h"
#include "coordinator/client/client.h"

namespace {

int Usage() {
  std::fprintf(stderr,
               "usage: mlaserve-cli [--endpoint E] [--server-key FILE --client-key FILE]\n"
               "                    (health | info | generate [opts] (TEXT | --ids 1,2) |\n"
               "                    chat [opts] [--system TEXT] MESSAGE)\n"
               "       mlaserve-cli keygen PREFIX [--label NAME]\n"
               "opts: --max-tokens N --temperature T --top-p P --top-k K --min-p P --seed S --stop STR\n"
               "      --ignore-eos --logprobs N --priority P --json\n");
  return 2;
}

// keygen PREFIX [--label NAME]: a fresh CURVE key pair in PREFIX.key and PREFIX.pub.
int Keygen(int argc, char** argv, int i) {
  std::string prefix, label;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--label" && i + 1 < argc) {
      label = argv[++i];
    } else if (a.rfind("--", 0) == 0 || !prefix.empty()) {
      return Usage();
    } else {
      prefix = a;
    }
  }
  if (prefix.empty()) return Usage();
  if (label.empty()) label = prefix.substr(prefix.find_last_of('/') + 1);
  auto pair = mlaserve::GenerateCurveKeyPair();
  absl::Status s = pair.ok() ? mlaserve::WriteCurveKeyFiles(prefix, *pair, label) : pair.status();
  if (!s.ok()) {
    std::fprintf(stderr, "mlaserve-cli: keygen: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("%s.key (key pair, mode 0600: keep it secret)\n%s.pub (public key: %s)\n",
              prefix.c_str(), prefix.c_str(), pair->public_key.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  std::string endpoint = "tcp://127.0.0.1:5555";
  ClientSecurity security;
  int i = 1;
  for (; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--endpoint") endpoint = argv[i + 1];
    else if (a == "--server-key") security.server_key_file = argv[i + 1];
    else if (a == "--client-key") security.client_key_file = argv[i + 1];
    else break;
  }
  if (i >= argc) return Usage();
  const std::string cmd = argv[i++];
  if (cmd == "keygen") return Keygen(argc, argv, i);
  auto client = Client::Connect(endpoint, security);
  if (!client.ok()) {
    std::fprintf(stderr, "mlaserve-cli: %s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  if (cmd == "health" || cmd == "info") {
    auto r = cmd == "health" ? (*client)->Health() : (*client)->Info();
    if (!r.ok()) {
      std::fprintf(stderr, "mlaserve-cli: %s\n", std::string(r.status().message()).c_str());
      return 1;
    }
    if (cmd == "health") {
      std::printf("%s %s\n", r->ok ? "ok" : "unhealthy", r->text.c_str());
      return r->ok ? 0 : 1;
    }
    std::printf("%s\n", r->text.c_str());
    return 0;
  }
  if (cmd != "generate" && cmd != "chat") return Usage();
  GenerateInput in;
  std::string system, text, ids;
  bool json_out = false;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) std::exit(Usage());
      return argv[++i];
    };
    auto num = [&](auto* out) {
      if (!absl::SimpleAtoi(next(), out)) std::exit(Usage());
    };
    auto real = [&](float* out) {
      if (!absl::SimpleAtof(next(), out)) std::exit(Usage());
    };
    if (a == "--max-tokens") num(&in.sampling.max_tokens);
    else if (a == "--temperature") real(&in.sampling.temperature);
    else if (a == "--top-p") real(&in.sampling.top_p);
    else if (a == "--top-k") num(&in.sampling.top_k);
    else if (a == "--min-p") real(&in.sampling.min_p);
    else if (a == "--seed") { uint64_t s; num(&s); in.sampling.seed = s; }
    else if (a == "--stop") in.sampling.stop.push_back(next());
    else if (a == "--ignore-eos") in.sampling.ignore_eos = true;
    else if (a == "--logprobs") { in.sampling.logprobs = true; num(&in.sampling.top_logprobs); }
    else if (a == "--priority") num(&in.sampling.priority);
    else if (a == "--system") system = next();
    else if (a == "--ids") ids = next();
    else if (a == "--json") json_out = true;
    else if (a.rfind("--", 0) == 0) return Usage();
    else text = a;
  }
  if (cmd == "chat") {
    nlohmann::json messages = nlohmann::json::array();
    if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
    messages.push_back({{"role", "user"}, {"content", text}});
    in.chat = messages;
  } else if (!ids.empty()) {
    std::vector<int32_t> v;
    for (absl::string_view p : absl::StrSplit(ids, ',', absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(p, &id)) return Usage();
      v.push_back(id);
    }
    in.token_ids = v;
  } else {
    in.text = text;
  }
  auto final = (*client)->Generate(in, [&](const Reply& chunk) {
    if (!json_out) {
      std::fwrite(chunk.text.data(), 1, chunk.text.size(), stdout);
      std::fflush(stdout);
    }
  });
  if (!final.ok()) {
    std::fprintf(stderr, "\nmlaserve-cli: %s\n", std::string(final.status().message()).c_str());
    return 1;
  }
  if (final->kind == Reply::Kind::kError) {
    std::fprintf(stderr, "mlaserve-cli: error %s: %s\n", final->error_code.c_str(), final->message.c_str());
    return 1;
  }
  if (json_out) {
    nlohmann::json j = {{"text", final->text}, {"token_ids", final->token_ids},
                        {"finish_reason", final->finish_reason},
                        {"usage", {{"prompt_tokens", final->prompt_tokens},
                                   {"completion_tokens", final->completion_tokens},
                                   {"cached_tokens", final->cached_tokens},
                                   {"queue_seconds", final->queue_seconds},
                                   {"ttft_seconds", final->ttft_seconds},
                                   {"total_seconds", final->total_seconds}}}};
    if (!final->message.empty()) j["message"] = final->message;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::fprintf(stderr, "\n[%s: %u prompt + %u completion tokens, ttft %.3f s, total %.3f s]\n",
                 final->finish_reason.c_str(), final->prompt_tokens, final->completion_tokens,
                 final->ttft_seconds, final->total_seconds);
  }
  return final->finish_reason == "error" ? 1 : 0;
}
