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
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "coordinator/auth/curve_keys.h"
#include "coordinator/client/client.h"

ABSL_FLAG(std::string, endpoint, "tcp://127.0.0.1:5555", "The coordinator's client endpoint.");
ABSL_FLAG(std::string, server_key, "",
          "The coordinator's public key file (.pub), for a CURVE coordinator; with --client-key.");
ABSL_FLAG(std::string, client_key, "",
          "This client's key pair file (.key; its .pub in the server's --curve-allowed-clients).");
// generate and chat (ranges: the coordinator's, coordinator/server/request_builder.cc).
ABSL_FLAG(uint32_t, max_tokens, 256, "generate, chat: most tokens to generate, in [1, 1048576].");
ABSL_FLAG(float, temperature, 0.0f,
          "generate, chat: sampling temperature, in [0, 100] (0: greedy).");
ABSL_FLAG(float, top_p, 1.0f, "generate, chat: nucleus sampling, in (0, 1].");
ABSL_FLAG(int32_t, top_k, 0,
          "generate, chat: sample among the K likeliest tokens, K >= 0 (0: all).");
ABSL_FLAG(float, min_p, 0.0f,
          "generate, chat: drop tokens below this fraction of the likeliest one's probability, in "
          "[0, 1].");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "generate, chat: sampling seed (default: none).");
ABSL_FLAG(mlaserve::StringList, stop, {},
          "generate, chat: a stop string (repeatable, at most 16).");
ABSL_FLAG(bool, ignore_eos, false, "generate, chat: keep generating past end-of-sequence tokens.");
ABSL_FLAG(
    std::optional<uint32_t>, logprobs, std::nullopt,
    "generate, chat: return each token's logprob and the N likeliest alternatives, N in [0, 20].");
ABSL_FLAG(int32_t, priority, 0, "generate, chat: scheduling priority (higher first).");
ABSL_FLAG(bool, json, false,
          "generate, chat: print the final reply as JSON instead of streaming the text.");
ABSL_FLAG(std::string, ids, "", "generate: the prompt as token ids, 1,2,3 (instead of TEXT).");
ABSL_FLAG(std::string, system, "", "chat: a system message before the user's.");
ABSL_FLAG(std::string, label, "",
          "keygen: the key's label in the files (default: PREFIX's file name).");

namespace {

constexpr char kUsage[] =
    "mlaserve-cli [--endpoint E] [--server-key FILE --client-key FILE]\n"
    "                    (health | info | generate [opts] (TEXT | --ids 1,2) |\n"
    "                    chat [opts] [--system TEXT] MESSAGE)\n"
    "       mlaserve-cli keygen PREFIX [--label NAME]";

// keygen PREFIX [--label NAME]: a fresh CURVE key pair in PREFIX.key and PREFIX.pub.
int Keygen(const std::string& prefix) {
  std::string label = absl::GetFlag(FLAGS_label);
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

// A usage error for each flag given that `cmd` does not take.
void RejectFlagsOf(const std::string& cmd,
                   std::initializer_list<const absl::CommandLineFlag*> flags) {
  for (const absl::CommandLineFlag* f : flags) {
    if (mlaserve::FlagGiven(*f))
      mlaserve::UsageError(mlaserve::FlagName(*f) + " is not a flag of " + cmd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  const std::vector<std::string> args = ParseCommandLine(argc, argv, kUsage);
  if (args.empty()) UsageError("a command is needed: health, info, generate, chat or keygen");
  const std::string& cmd = args[0];
  const auto& h = [](const auto& flag) { return &absl::GetFlagReflectionHandle(flag); };
  const std::initializer_list<const absl::CommandLineFlag*> sampling_flags = {
      h(FLAGS_max_tokens), h(FLAGS_temperature), h(FLAGS_top_p), h(FLAGS_top_k),
      h(FLAGS_min_p),      h(FLAGS_seed),        h(FLAGS_stop),  h(FLAGS_ignore_eos),
      h(FLAGS_logprobs),   h(FLAGS_priority),    h(FLAGS_json),  h(FLAGS_ids),
      h(FLAGS_system)};
  if (cmd != "keygen") RejectFlagsOf(cmd, {h(FLAGS_label)});
  if (cmd != "generate" && cmd != "chat") RejectFlagsOf(cmd, sampling_flags);
  if (cmd != "generate") RejectFlagsOf(cmd, {h(FLAGS_ids)});
  if (cmd != "chat") RejectFlagsOf(cmd, {h(FLAGS_system)});
  if (cmd == "keygen") {
    if (args.size() != 2) UsageError("keygen takes one PREFIX");
    return Keygen(args[1]);
  }
  if (cmd != "health" && cmd != "info" && cmd != "generate" && cmd != "chat") {
    UsageError("unknown command " + cmd + " (health, info, generate, chat or keygen)");
  }
  if ((cmd == "health" || cmd == "info") && args.size() != 1) {
    UsageError(cmd + " takes no arguments");
  }
  // generate and chat: the prompt and sampling, all checked before connecting.
  GenerateInput in;
  const bool json_out = absl::GetFlag(FLAGS_json);
  if (cmd == "generate" || cmd == "chat") {
    const std::string what = cmd == "chat" ? "MESSAGE" : "TEXT";
    if (args.size() > 2) UsageError(cmd + " takes one " + what + " (quote it)");
    const std::string text = args.size() == 2 ? args[1] : "";
    const std::string ids = absl::GetFlag(FLAGS_ids);
    if (cmd == "chat") {
      nlohmann::json messages = nlohmann::json::array();
      const std::string system = absl::GetFlag(FLAGS_system);
      if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
      messages.push_back({{"role", "user"}, {"content", text}});
      in.chat = messages;
    } else if (!ids.empty()) {
      if (args.size() == 2) UsageError("generate takes TEXT or --ids, not both");
      std::vector<int32_t> v;
      for (absl::string_view p : absl::StrSplit(ids, ',', absl::SkipEmpty())) {
        int32_t id;
        if (!absl::SimpleAtoi(p, &id))
          UsageError("--ids " + ids + ": not a list of token ids 1,2,3");
        v.push_back(id);
      }
      in.token_ids = v;
    } else {
      in.text = text;
    }
    ClientSampling& s = in.sampling;
    s.max_tokens = FlagInRange(FLAGS_max_tokens, 1, 1 << 20);
    s.temperature = FlagInRange(FLAGS_temperature, 0, 100);
    s.top_p = absl::GetFlag(FLAGS_top_p);
    if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) {
      UsageError(absl::StrCat("--top-p ", s.top_p, ": must be in (0, 1]"));
    }
    s.top_k = FlagInRange(FLAGS_top_k, 0, std::numeric_limits<int32_t>::max());
    s.min_p = FlagInRange(FLAGS_min_p, 0, 1);
    s.seed = absl::GetFlag(FLAGS_seed);
    s.stop = absl::GetFlag(FLAGS_stop).values;
    s.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
    if (const std::optional<uint32_t> n = absl::GetFlag(FLAGS_logprobs)) {
      if (*n > 20) UsageError(absl::StrCat("--logprobs ", *n, ": must be in [0, 20]"));
      s.logprobs = true;
      s.top_logprobs = *n;
    }
    s.priority = absl::GetFlag(FLAGS_priority);
  }
  ClientSecurity security;
  security.server_key_file = absl::GetFlag(FLAGS_server_key);
  security.client_key_file = absl::GetFlag(FLAGS_client_key);
  auto client = Client::Connect(absl::GetFlag(FLAGS_endpoint), security);
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
