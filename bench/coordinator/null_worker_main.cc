// mlaserve-null-worker: speaks the worker side of the step protocol with no model, answering
// each step plan at once with a token per sampled sequence (token = (last fed token + 1) mod
// vocab). It isolates the coordinator's own cost per step (scheduling, plan encoding, result
// handling and streaming) for bench/coordinator/run_overhead.sh; it is not a test double: no
// test uses it.
//
//   mlaserve-null-worker --coordinator ENDPOINT [--vocab 512] [--kv-blocks 4096]
#include <cstdio>
#include <cstring>
#include <string>

#include "capnp/message.h"
#include "capnp/serialize.h"
#include "common/command_line.h"
#include "mlaserve.capnp.h"
#include "nlohmann/json.hpp"
#include "zmq.hpp"

ABSL_FLAG(std::string, coordinator, "",
          "The coordinator's worker endpoint (its --worker-listen); required.");
ABSL_FLAG(int32_t, vocab, 512, "Vocabulary size reported to the coordinator, in [1, 16777216].");
ABSL_FLAG(int32_t, kv_blocks, 4096, "KV blocks reported to the coordinator, in [1, 16777216].");

int main(int argc, char** argv) {
  using namespace mlaserve;
  ParseFlags(argc, argv, "mlaserve-null-worker --coordinator ENDPOINT [--vocab N] [--kv-blocks N]");
  const std::string endpoint = RequiredFlag(FLAGS_coordinator, "ENDPOINT");
  const int vocab = FlagInRange(FLAGS_vocab, 1, 1 << 24);
  const int kv_blocks = FlagInRange(FLAGS_kv_blocks, 1, 1 << 24);
  zmq::context_t ctx(1);
  zmq::socket_t sock(ctx, zmq::socket_type::dealer);
  sock.set(zmq::sockopt::routing_id, "worker");
  sock.connect(endpoint);
  zmq::socket_t hb(ctx, zmq::socket_type::dealer);
  hb.set(zmq::sockopt::routing_id, "heartbeat");
  hb.connect(endpoint);
  auto send = [](zmq::socket_t& s, capnp::MessageBuilder& msg) {
    kj::Array<capnp::word> w = capnp::messageToFlatArray(msg);
    auto b = w.asBytes();
    s.send(zmq::const_buffer(b.begin(), b.size()), zmq::send_flags::none);
  };
  {
    nlohmann::json info = {{"model", "null"}, {"ranks", 1}, {"kv_format", "none"}, {"kv_blocks", kv_blocks},
                           {"vocab_size", vocab}, {"max_position_embeddings", 1 << 20},
                           {"eos_token_ids", std::vector<int>{}}, {"backend", "null"}};
    capnp::MallocMessageBuilder msg;
    msg.initRoot<wire::StepResult>().setReady(info.dump());
    send(sock, msg);
  }
  capnp::MallocMessageBuilder beat;
  beat.initRoot<wire::StepResult>().setPong();
  for (;;) {
    zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(250)) == 0) {
      send(hb, beat);
      continue;
    }
    zmq::message_t m;
    if (!sock.recv(m)) continue;
    kj::Array<capnp::word> words = kj::heapArray<capnp::word>(m.size() / sizeof(capnp::word));
    std::memcpy(words.begin(), m.data(), m.size());
    capnp::ReaderOptions opts;
    opts.traversalLimitInWords = 1ull << 30;
    capnp::FlatArrayMessageReader reader(words, opts);
    auto plan = reader.getRoot<wire::StepPlan>();
    if (plan.isShutdown()) break;
    if (plan.isPing()) {
      send(hb, beat);
      continue;
    }
    capnp::MallocMessageBuilder msg;
    auto r = msg.initRoot<wire::StepResult>();
    r.setStepId(plan.getStepId());
    int n = 0;
    for (auto s : plan.getStep()) n += s.getSample();
    auto list = r.initSampled(n);
    int i = 0;
    for (auto s : plan.getStep()) {
      if (!s.getSample()) continue;
      list[i].setSeqId(s.getSeqId());
      list[i].setTokenId((s.getTokens()[s.getTokens().size() - 1] + 1) % vocab);
      ++i;
    }
    r.initRankSeconds(1).set(0, 0.0);
    send(sock, msg);
  }
  return 0;
}
