// RunWithStack (coordinator/http/large_stack.h): mlaserve-openai renders chat prompts on a thread
// of their own because civetweb's 100 KiB stacks are too small for the renderer.
#include "coordinator/http/large_stack.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <stdexcept>
#include <string>

#include "coordinator/chat_template/chat_template.h"
#include "nlohmann/json.hpp"

namespace mlaserve::openai {
namespace {

size_t ThisThreadsStack() {
  pthread_attr_t attr;
  size_t bytes = 0;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    pthread_attr_getstacksize(&attr, &bytes);
    pthread_attr_destroy(&attr);
  }
  return bytes;
}

TEST(LargeStackTest, RunsOnAThreadWithTheStackAskedFor) {
  size_t stack = 0;
  ASSERT_TRUE(RunWithStack(kChatPromptStackBytes, [&] { stack = ThisThreadsStack(); }).ok());
  EXPECT_GE(stack, kChatPromptStackBytes);
  EXPECT_THROW((void)RunWithStack(1 << 20, [] { throw std::runtime_error("from the thread"); }),
               std::runtime_error);
}

// The deepest rendering the renderer allows (jinja::RenderLimits::max_depth, reached here by a
// macro recursing through 45 nested ifs until the bound stops it) fits kChatPromptStackBytes; in
// the sanitizer build this checks the size under ASan's larger frames.
TEST(LargeStackTest, TheDeepestRenderingFitsTheChatPromptStack) {
  std::string body;
  for (int i = 0; i < 45; ++i) body += "{% if true %}";
  body += "{{ m(n - 1) if n > 0 else 'end' }}";
  for (int i = 0; i < 45; ++i) body += "{% endif %}";
  absl::StatusOr<ChatTemplate> t =
      ChatTemplate::Parse("{% macro m(n) %}" + body + "{% endmacro %}{{ m(62) }}");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::string> out;
  ASSERT_TRUE(
      RunWithStack(kChatPromptStackBytes, [&] { out = t->Render(nlohmann::json::object()); }).ok());
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("more than 256 deep"), std::string::npos) << out.status();
}

}  // namespace
}  // namespace mlaserve::openai
