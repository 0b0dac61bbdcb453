// MessageScratch: a message that fits the scratch has exactly capnp::messageToFlatArray's bytes,
// also after a larger one spilled past it (the first segment must have been re-zeroed); one that
// spills is a valid multi-segment message with the same content.
#include "schema/message_scratch.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "schema/mlaserve.capnp.h"

namespace mlaserve {
namespace {

void BuildReply(capnp::MessageBuilder& msg, uint64_t id, const std::string& text, int tokens) {
  auto reply = msg.initRoot<wire::ServerReply>();
  reply.setRequestId(id);
  auto chunk = reply.initChunk();
  auto ids = chunk.initTokenIds(tokens);
  for (int i = 0; i < tokens; ++i) ids.set(i, 1000 + i);
  chunk.setText(text);
}

std::string Reference(uint64_t id, const std::string& text, int tokens) {
  capnp::MallocMessageBuilder msg;
  BuildReply(msg, id, text, tokens);
  auto words = capnp::messageToFlatArray(msg);
  auto b = words.asBytes();
  return std::string(reinterpret_cast<const char*>(b.begin()), b.size());
}

// Decodes a flat message and checks its content.
void ExpectReply(const std::string& bytes, uint64_t id, const std::string& text, int tokens) {
  ASSERT_EQ(bytes.size() % sizeof(capnp::word), 0u);
  auto words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  capnp::FlatArrayMessageReader reader(words);
  auto reply = reader.getRoot<wire::ServerReply>();
  EXPECT_EQ(reply.getRequestId(), id);
  ASSERT_TRUE(reply.isChunk());
  EXPECT_EQ(std::string(reply.getChunk().getText().cStr()), text);
  auto ids = reply.getChunk().getTokenIds();
  ASSERT_EQ(ids.size(), static_cast<unsigned>(tokens));
  for (int i = 0; i < tokens; ++i) EXPECT_EQ(ids[i], 1000 + i);
}

TEST(MessageScratchTest, SameBytesAsMessageToFlatArray) {
  MessageScratch scratch(16);
  // Small, then one that spills past 16 words, then small again over the reused segment.
  const struct {
    uint64_t id;
    std::string text;
    int tokens;
    bool fits;
  } cases[] = {{7, "hi", 1, true},
               {8, std::string(500, 'x'), 40, false},
               {9, "", 1, true},
               {10, "abc", 3, true}};
  for (const auto& c : cases) {
    std::string got;
    {
      capnp::MallocMessageBuilder msg(scratch.FirstSegment());
      BuildReply(msg, c.id, c.text, c.tokens);
      auto bytes = scratch.Flatten(msg);
      got.assign(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
    }
    ExpectReply(got, c.id, c.text, c.tokens);
    if (c.fits) EXPECT_EQ(got, Reference(c.id, c.text, c.tokens)) << "request " << c.id;
  }
}

TEST(MessageScratchTest, GrowsTheFirstSegmentZeroed) {
  MessageScratch scratch(4);
  auto seg = scratch.FirstSegment(100);
  ASSERT_GE(seg.size(), 100u);
  const auto* p = reinterpret_cast<const unsigned char*>(seg.begin());
  for (size_t i = 0; i < seg.size() * sizeof(capnp::word); ++i) ASSERT_EQ(p[i], 0) << i;
  std::string got;
  {
    capnp::MallocMessageBuilder msg(seg);
    BuildReply(msg, 3, "grown", 50);
    auto bytes = scratch.Flatten(msg);
    got.assign(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
  }
  EXPECT_EQ(got, Reference(3, "grown", 50));
  ExpectReply(got, 3, "grown", 50);
}

}  // namespace
}  // namespace mlaserve
