#include "coordinator/chat_template/jinja_template.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mlaserve::jinja {

// ---------------------------------------------------------------------------------------------
// Syntax tree.

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kGetAttr,
    kGetItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kPos,
    kBinary,
    kCompare,
    kAnd,
    kOr,
    kCondition,
    kList,
    kDict
  };
  Kind kind;
  Value literal;                            // kLiteral
  std::string name;                         // kName, kGetAttr attribute, kFilter, kTest, op
  std::vector<std::unique_ptr<Expr>> args;  // operands / positional arguments
  std::vector<std::string> keyword_names;   // trailing args with names (calls, filters, tests)
  std::vector<std::string> compare_ops;     // kCompare: op between args[i] and args[i + 1]
  bool negated = false;                     // kTest: "is not"
  int line = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Node {
  enum class Kind { kBody, kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue };
  Kind kind = Kind::kBody;
  std::string text;                  // kText; kSet/kSetBlock/kMacro name
  std::string attribute;             // kSet on namespace attribute
  std::vector<std::string> targets;  // kFor loop variables; kMacro parameter names
  std::vector<ExprPtr> exprs;        // kOutput: [e]; kIf: conditions; kFor: [iter, filter?];
                                     // kSet: [value]; kMacro: parameter defaults (or null)
  std::vector<std::unique_ptr<Node>> children;  // kBody: statements; kIf: bodies (+ else);
                                                // kFor: [body, else?]; kMacro/kSetBlock: [body]
  int line = 0;
};
using NodePtr = std::unique_ptr<Node>;

namespace {

// ---------------------------------------------------------------------------------------------
// Lexing: template text into text, {{ }} and {% %} items, applying whitespace control.

struct Item {
  enum class Kind { kText, kVariable, kBlock } kind;
  std::string content;
  int line;
};

class SyntaxError : public std::runtime_error {
 public:
  SyntaxError(int line, const std::string& message)
      : std::runtime_error(absl::StrCat("line ", line, ": ", message)) {}
};

bool IsPySpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string RStrip(std::string s) {
  while (!s.empty() && IsPySpace(s.back())) s.pop_back();
  return s;
}

// Position of the tag end `close` ("}}" or "%}") starting the scan at `pos`, skipping string
// literals; npos if absent.
size_t FindTagEnd(const std::string& s, size_t pos, const char* close) {
  while (pos < s.size()) {
    const char c = s[pos];
    if (c == '\'' || c == '"') {
      ++pos;
      while (pos < s.size() && s[pos] != c) pos += s[pos] == '\\' ? 2 : 1;
      ++pos;
    } else if (s.compare(pos, 2, close) == 0) {
      return pos;
    } else {
      ++pos;
    }
  }
  return std::string::npos;
}

std::vector<Item> Lex(std::string_view raw_source) {
  // jinja2 normalises newlines to "\n" and drops one trailing newline (keep_trailing_newline off).
  std::string source;
  for (size_t i = 0; i < raw_source.size(); ++i) {
    if (raw_source[i] == '\r') {
      source.push_back('\n');
      if (i + 1 < raw_source.size() && raw_source[i + 1] == '\n') ++i;
    } else {
      source.push_back(raw_source[i]);
    }
  }
  if (!source.empty() && source.back() == '\n') source.pop_back();

  std::vector<Item> items;
  size_t pos = 0;
  bool line_starting = true;  // the previous match ended with a newline (or nothing came before)
  int line = 1;
  const auto count_lines = [&](size_t from, size_t to) {
    line += static_cast<int>(std::count(source.begin() + from, source.begin() + to, '\n'));
  };
  while (pos <= source.size()) {
    size_t start = pos;
    size_t tag = std::string::npos;
    while ((start = source.find('{', start)) != std::string::npos) {
      if (start + 1 < source.size() &&
          (source[start + 1] == '{' || source[start + 1] == '%' || source[start + 1] == '#')) {
        tag = start;
        break;
      }
      ++start;
    }
    std::string text = source.substr(pos, (tag == std::string::npos ? source.size() : tag) - pos);
    if (tag == std::string::npos) {
      if (!text.empty()) items.push_back({Item::Kind::kText, text, line});
      break;
    }
    const char type = source[tag + 1];
    const char sign = tag + 2 < source.size() ? source[tag + 2] : '\0';
    if (sign == '-') {
      text = RStrip(text);
    } else if (sign != '+' && type != '{') {
      // lstrip_blocks: drop spaces and tabs between a line start and a block or comment tag.
      const size_t line_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      if (line_pos > 0 || line_starting) {
        bool blank = true;
        for (size_t i = line_pos; i < text.size(); ++i) blank = blank && IsPySpace(text[i]);
        if (blank) text.resize(line_pos);
      }
    }
    if (!text.empty()) items.push_back({Item::Kind::kText, text, line});
    count_lines(pos, tag);
    const int tag_line = line;
    const size_t body_start = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
    size_t end;
    if (type == '#') {
      end = source.find("#}", body_start);
    } else {
      end = FindTagEnd(source, body_start, type == '{' ? "}}" : "%}");
    }
    if (end == std::string::npos) throw SyntaxError(tag_line, "unterminated tag");
    const char end_sign = end > body_start ? source[end - 1] : '\0';
    const bool strip_after = end_sign == '-';
    const bool keep_newline = end_sign == '+';
    std::string content = source.substr(
        body_start, end - body_start - ((strip_after || keep_newline) && type != '#' ? 1 : 0));
    count_lines(tag, end + 2);
    pos = end + 2;
    if (strip_after) {
      while (pos < source.size() && IsPySpace(source[pos])) {
        if (source[pos] == '\n') ++line;
        ++pos;
      }
    } else if (type != '{' && !keep_newline && pos < source.size() && source[pos] == '\n') {
      ++pos;  // trim_blocks
      ++line;
    }
    line_starting = source[pos - 1] == '\n';
    if (type == '#') continue;
    // {% raw %}: everything up to {% endraw %} is text.
    std::string trimmed = content;
    trimmed.erase(0, trimmed.find_first_not_of(" \t\n"));
    trimmed = RStrip(trimmed);
    if (type == '%' && trimmed == "raw") {
      size_t search = pos, raw_end;
      while (true) {
        raw_end = source.find("{%", search);
        if (raw_end == std::string::npos) throw SyntaxError(tag_line, "missing endraw");
        size_t k = raw_end + 2;
        if (k < source.size() && (source[k] == '-' || source[k] == '+')) ++k;
        while (k < source.size() && IsPySpace(source[k])) ++k;
        if (source.compare(k, 6, "endraw") == 0) break;
        search = raw_end + 2;
      }
      std::string raw_text = source.substr(pos, raw_end - pos);
      if (source[raw_end + 2] == '-') raw_text = RStrip(raw_text);
      if (!raw_text.empty()) items.push_back({Item::Kind::kText, raw_text, line});
      const size_t close = FindTagEnd(source, raw_end + 2, "%}");
      if (close == std::string::npos) throw SyntaxError(tag_line, "unterminated endraw");
      count_lines(pos, close + 2);
      pos = close + 2;
      if (source[close - 1] == '-') {
        while (pos < source.size() && IsPySpace(source[pos])) ++pos;
      } else if (source[close - 1] != '+' && pos < source.size() && source[pos] == '\n') {
        ++pos;
      }
      line_starting = source[pos - 1] == '\n';
      continue;
    }
    items.push_back({type == '{' ? Item::Kind::kVariable : Item::Kind::kBlock, content, tag_line});
  }
  return items;
}

// ---------------------------------------------------------------------------------------------
// Expression tokens.

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
  Value value;
};

std::vector<Token> Tokenize(const std::string& s, int line) {
  std::vector<Token> tokens;
  size_t i = 0;
  static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                               "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                               "]",  "{",  "}",  ",",  ".",  ":",  "|"};
  while (i < s.size()) {
    const char c = s[i];
    if (IsPySpace(c)) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      tokens.push_back({Token::Kind::kName, s.substr(i, j - i), Value()});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        is_float = true;
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        is_float = true;
        ++j;
        if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      std::string number = s.substr(i, j - i);
      number.erase(std::remove(number.begin(), number.end(), '_'), number.end());
      tokens.push_back(is_float
                           ? Token{Token::Kind::kFloat, number, Value::Float(std::stod(number))}
                           : Token{Token::Kind::kInt, number, Value::Int(std::stoll(number))});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string value;
      size_t j = i + 1;
      while (j < s.size() && s[j] != c) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[j + 1];
          j += 2;
          switch (e) {
            case 'n':
              value.push_back('\n');
              break;
            case 't':
              value.push_back('\t');
              break;
            case 'r':
              value.push_back('\r');
              break;
            case '\\':
              value.push_back('\\');
              break;
            case '\'':
              value.push_back('\'');
              break;
            case '"':
              value.push_back('"');
              break;
            case '\n':
              break;
            default:
              value.push_back('\\');
              value.push_back(e);
          }
        } else {
          value.push_back(s[j++]);
        }
      }
      if (j >= s.size()) throw SyntaxError(line, "unterminated string literal");
      tokens.push_back({Token::Kind::kString, value, Value::String(value)});
      i = j + 1;
    } else {
      bool matched = false;
      for (const char* op : kOps) {
        const size_t len = std::char_traits<char>::length(op);
        if (s.compare(i, len, op) == 0) {
          tokens.push_back({Token::Kind::kOp, op, Value()});
          i += len;
          matched = true;
          break;
        }
      }
      if (!matched)
        throw SyntaxError(line, absl::StrCat("unexpected character '", std::string(1, c), "'"));
    }
  }
  tokens.push_back({Token::Kind::kEnd, "", Value()});
  return tokens;
}

const std::unordered_set<std::string>& KnownFilters() {
  static const std::unordered_set<std::string> filters = {
      "abs",        "capitalize", "count",    "d",       "default", "dictsort", "e",
      "escape",     "first",      "float",    "indent",  "int",     "items",    "join",
      "last",       "length",     "list",     "lower",   "map",     "max",      "min",
      "reject",     "rejectattr", "replace",  "reverse", "round",   "safe",     "select",
      "selectattr", "sort",       "string",   "sum",     "title",   "tojson",   "trim",
      "unique",     "upper",      "wordcount"};
  return filters;
}

const std::unordered_set<std::string>& KnownTests() {
  static const std::unordered_set<std::string> tests = {
      "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
      "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
      "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
      "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper",
      "==",      "!=",       "<",        ">",           "<=",   ">="};
  return tests;
}

// ---------------------------------------------------------------------------------------------
// Expression parser (precedence as jinja2's parser).

// How deep expressions and blocks may nest: the parsers and the renderer recurse once per level.
constexpr int kMaxParseDepth = 100;

class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens, int line) : tokens_(std::move(tokens)), line_(line) {}

  // Counts one level of expression nesting while alive.
  struct Nesting {
    explicit Nesting(ExprParser* p) : parser(p) {
      if (++parser->depth_ > kMaxParseDepth) {
        throw SyntaxError(parser->line_, absl::StrCat("expression nested more than ",
                                                      kMaxParseDepth, " deep"));
      }
    }
    ~Nesting() { --parser->depth_; }
    ExprParser* parser;
  };

  const Token& Peek(size_t ahead = 0) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  bool AtEnd() const { return Peek().kind == Token::Kind::kEnd; }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kName && Peek(ahead).text == name;
  }
  Token Next() { return tokens_[pos_ < tokens_.size() - 1 ? pos_++ : pos_]; }
  void Expect(const char* op) {
    if (!IsOp(op)) Fail(absl::StrCat("expected '", op, "', found '", Peek().text, "'"));
    ++pos_;
  }
  std::string ExpectName() {
    if (Peek().kind != Token::Kind::kName)
      Fail(absl::StrCat("expected a name, found '", Peek().text, "'"));
    return Next().text;
  }
  [[noreturn]] void Fail(const std::string& message) const { throw SyntaxError(line_, message); }
  void ExpectEnd() {
    if (!AtEnd()) Fail(absl::StrCat("unexpected '", Peek().text, "'"));
  }

  ExprPtr Make(Expr::Kind kind) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line_;
    return e;
  }

  // expression := or ["if" or ["else" expression]]
  ExprPtr Expression(bool with_condition = true) {
    ExprPtr e = Or();
    if (with_condition && IsName("if")) {
      ++pos_;
      auto cond = Make(Expr::Kind::kCondition);
      cond->args.push_back(std::move(e));
      cond->args.push_back(Or());
      if (IsName("else")) {
        ++pos_;
        cond->args.push_back(Expression());
      }
      return cond;
    }
    return e;
  }
  ExprPtr Or() {
    ExprPtr left = And();
    while (IsName("or")) {
      ++pos_;
      auto e = Make(Expr::Kind::kOr);
      e->args.push_back(std::move(left));
      e->args.push_back(And());
      left = std::move(e);
    }
    return left;
  }
  ExprPtr And() {
    ExprPtr left = Not();
    while (IsName("and")) {
      ++pos_;
      auto e = Make(Expr::Kind::kAnd);
      e->args.push_back(std::move(left));
      e->args.push_back(Not());
      left = std::move(e);
    }
    return left;
  }
  ExprPtr Not() {
    const Nesting nesting(this);
    if (IsName("not")) {
      ++pos_;
      auto e = Make(Expr::Kind::kNot);
      e->args.push_back(Not());
      return e;
    }
    return Compare();
  }
  ExprPtr Compare() {
    ExprPtr first = Math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      if (Peek().kind == Token::Kind::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == ">" ||
           Peek().text == "<=" || Peek().text == ">=")) {
        op = Next().text;
      } else if (IsName("in")) {
        ++pos_;
        op = "in";
      } else if (IsName("not") && IsName("in", 1)) {
        pos_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = Make(Expr::Kind::kCompare);
        cmp->args.push_back(std::move(first));
      }
      cmp->compare_ops.push_back(op);
      cmp->args.push_back(Math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprPtr Binary(ExprPtr left, const std::string& op, ExprPtr right) {
    auto e = Make(Expr::Kind::kBinary);
    e->name = op;
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }
  ExprPtr Math1() {  // jinja2: concat (~) binds looser than + and -
    ExprPtr left = Sum();
    while (IsOp("~")) {
      ++pos_;
      left = Binary(std::move(left), "~", Sum());
    }
    return left;
  }
  ExprPtr Sum() {
    ExprPtr left = Product();
    while (IsOp("+") || IsOp("-")) {
      const std::string op = Next().text;
      left = Binary(std::move(left), op, Product());
    }
    return left;
  }
  ExprPtr Product() {
    ExprPtr left = Power();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string op = Next().text;
      left = Binary(std::move(left), op, Power());
    }
    return left;
  }
  ExprPtr Power() {
    ExprPtr left = Unary();
    while (IsOp("**")) {
      ++pos_;
      left = Binary(std::move(left), "**", Unary());
    }
    return left;
  }
  // As jinja2: "-x|f" is "(-x)|f"; the operand of a sign takes no filters of its own.
  ExprPtr Unary(bool with_filter = true) {
    const Nesting nesting(this);
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const bool neg = Next().text == "-";
      node = Make(neg ? Expr::Kind::kNeg : Expr::Kind::kPos);
      node->args.push_back(Unary(false));
    } else {
      node = Primary();
    }
    node = Postfix(std::move(node));
    return with_filter ? FilterChain(std::move(node)) : std::move(node);
  }
  ExprPtr Primary() {
    const Token t = Next();
    switch (t.kind) {
      case Token::Kind::kString: {
        // Adjacent string literals concatenate.
        std::string s = t.text;
        while (Peek().kind == Token::Kind::kString) s += Next().text;
        auto e = Make(Expr::Kind::kLiteral);
        e->literal = Value::String(s);
        return e;
      }
      case Token::Kind::kInt:
      case Token::Kind::kFloat: {
        auto e = Make(Expr::Kind::kLiteral);
        e->literal = t.value;
        return e;
      }
      case Token::Kind::kName: {
        auto e = Make(Expr::Kind::kLiteral);
        if (t.text == "true" || t.text == "True") {
          e->literal = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      }
      case Token::Kind::kOp:
        if (t.text == "(") {
          ExprPtr inner = Expression();
          if (IsOp(",")) {  // tuple: a list for our purposes
            auto list = Make(Expr::Kind::kList);
            list->args.push_back(std::move(inner));
            while (IsOp(",")) {
              ++pos_;
              if (IsOp(")")) break;
              list->args.push_back(Expression());
            }
            inner = std::move(list);
          }
          Expect(")");
          return inner;
        }
        if (t.text == "[") {
          auto list = Make(Expr::Kind::kList);
          while (!IsOp("]")) {
            list->args.push_back(Expression());
            if (!IsOp(",")) break;
            ++pos_;
          }
          Expect("]");
          return list;
        }
        if (t.text == "{") {
          auto dict = Make(Expr::Kind::kDict);
          while (!IsOp("}")) {
            dict->args.push_back(Expression());
            Expect(":");
            dict->args.push_back(Expression());
            if (!IsOp(",")) break;
            ++pos_;
          }
          Expect("}");
          return dict;
        }
        [[fallthrough]];
      default:
        Fail(t.kind == Token::Kind::kEnd ? "unexpected end of expression"
                                         : absl::StrCat("unexpected '", t.text, "'"));
    }
  }
  // Call arguments after "(": positional then keyword.
  void CallArguments(Expr* call) {
    bool keyword_seen = false;
    while (!IsOp(")")) {
      if (Peek().kind == Token::Kind::kName && IsOp("=", 1)) {
        call->keyword_names.push_back(Next().text);
        ++pos_;
        keyword_seen = true;
      } else if (keyword_seen) {
        Fail("positional argument after keyword argument");
      }
      call->args.push_back(Expression());
      if (!IsOp(",")) break;
      ++pos_;
    }
    Expect(")");
  }
  ExprPtr Postfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        ++pos_;
        auto attr = Make(Expr::Kind::kGetAttr);
        if (Peek().kind == Token::Kind::kInt) {
          attr->kind = Expr::Kind::kGetItem;
          auto index = Make(Expr::Kind::kLiteral);
          index->literal = Next().value;
          attr->args.push_back(std::move(e));
          attr->args.push_back(std::move(index));
        } else {
          attr->name = ExpectName();
          attr->args.push_back(std::move(e));
        }
        e = std::move(attr);
      } else if (IsOp("[")) {
        ++pos_;
        ExprPtr parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!IsOp(":") && !IsOp("]")) parts[k] = Expression();
          if (k < 2 && IsOp(":")) {
            ++pos_;
            slice = true;
          } else {
            break;
          }
        }
        Expect("]");
        auto sub = Make(slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem);
        sub->args.push_back(std::move(e));
        if (slice) {
          for (auto& p : parts) sub->args.push_back(std::move(p));  // null = omitted
        } else {
          if (!parts[0]) Fail("empty subscript");
          sub->args.push_back(std::move(parts[0]));
        }
        e = std::move(sub);
      } else if (IsOp("(")) {
        ++pos_;
        auto call = Make(Expr::Kind::kCall);
        call->args.push_back(std::move(e));
        CallArguments(call.get());
        e = std::move(call);
      } else {
        return e;
      }
    }
  }
  ExprPtr FilterChain(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        ++pos_;
        auto filter = Make(Expr::Kind::kFilter);
        filter->name = ExpectName();
        if (!KnownFilters().count(filter->name))
          Fail(absl::StrCat("no filter named '", filter->name, "'"));
        filter->args.push_back(std::move(e));
        if (IsOp("(")) {
          ++pos_;
          CallArguments(filter.get());
        }
        e = std::move(filter);
      } else if (IsName("is")) {
        ++pos_;
        auto test = Make(Expr::Kind::kTest);
        if (IsName("not")) {
          ++pos_;
          test->negated = true;
        }
        if (Peek().kind == Token::Kind::kName) {
          test->name = Next().text;
        } else if (Peek().kind == Token::Kind::kOp) {
          test->name = Next().text;
        } else {
          Fail("expected a test name after 'is'");
        }
        if (!KnownTests().count(test->name)) Fail(absl::StrCat("no test named '", test->name, "'"));
        test->args.push_back(std::move(e));
        if (IsOp("(")) {
          ++pos_;
          CallArguments(test.get());
        } else if (Peek().kind == Token::Kind::kString || Peek().kind == Token::Kind::kInt ||
                   Peek().kind == Token::Kind::kFloat ||
                   (Peek().kind == Token::Kind::kName && !IsName("and") && !IsName("or") &&
                    !IsName("else") && !IsName("if") && !IsName("in") && !IsName("not") &&
                    !IsName("is"))) {
          test->args.push_back(Postfix(Primary()));
        }
        e = std::move(test);
      } else {
        return e;
      }
    }
  }

 private:
  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int line_;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Statement parser.

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Item> items) : items_(std::move(items)) {}

  NodePtr ParseAll() {
    std::string end;
    NodePtr body = ParseBody({}, &end);
    return body;
  }

 private:
  // Parses statements until a block tag whose first word is in `ends`; returns that tag's parser
  // through `end_parser` (positioned after the word).
  NodePtr ParseBody(const std::vector<std::string>& ends, std::string* end_word,
                    std::unique_ptr<ExprParser>* end_parser = nullptr) {
    if (++depth_ > kMaxParseDepth) {
      throw SyntaxError(pos_ < items_.size() ? items_[pos_].line : 0,
                        absl::StrCat("blocks nested more than ", kMaxParseDepth, " deep"));
    }
    struct Leave {
      int* depth;
      ~Leave() { --*depth; }
    } leave{&depth_};
    auto body = std::make_unique<Node>();
    body->kind = Node::Kind::kBody;
    while (pos_ < items_.size()) {
      const Item& item = items_[pos_++];
      if (item.kind == Item::Kind::kText) {
        auto text = std::make_unique<Node>();
        text->kind = Node::Kind::kText;
        text->text = item.content;
        body->children.push_back(std::move(text));
        continue;
      }
      auto parser = std::make_unique<ExprParser>(Tokenize(item.content, item.line), item.line);
      if (item.kind == Item::Kind::kVariable) {
        auto out = std::make_unique<Node>();
        out->kind = Node::Kind::kOutput;
        out->line = item.line;
        out->exprs.push_back(parser->Expression());
        parser->ExpectEnd();
        body->children.push_back(std::move(out));
        continue;
      }
      const std::string word = parser->ExpectName();
      if (std::find(ends.begin(), ends.end(), word) != ends.end()) {
        *end_word = word;
        if (end_parser) *end_parser = std::move(parser);
        return body;
      }
      body->children.push_back(Statement(word, *parser, item.line));
    }
    if (!ends.empty()) {
      throw SyntaxError(items_.empty() ? 0 : items_.back().line,
                        absl::StrCat("unexpected end of template, expected '", ends.front(), "'"));
    }
    return body;
  }

  NodePtr Statement(const std::string& word, ExprParser& p, int line) {
    auto node = std::make_unique<Node>();
    node->line = line;
    std::string end;
    if (word == "if") {
      node->kind = Node::Kind::kIf;
      node->exprs.push_back(p.Expression());
      p.ExpectEnd();
      while (true) {
        std::unique_ptr<ExprParser> tail;
        node->children.push_back(ParseBody({"elif", "else", "endif"}, &end, &tail));
        if (end == "elif") {
          node->exprs.push_back(tail->Expression());
          tail->ExpectEnd();
        } else if (end == "else") {
          tail->ExpectEnd();
          node->children.push_back(ParseBody({"endif"}, &end));
          break;
        } else {
          break;
        }
      }
    } else if (word == "for") {
      node->kind = Node::Kind::kFor;
      node->targets.push_back(p.ExpectName());
      while (p.IsOp(",")) {
        p.Next();
        node->targets.push_back(p.ExpectName());
      }
      if (!p.IsName("in")) p.Fail("expected 'in' in for loop");
      p.Next();
      node->exprs.push_back(p.Expression(/*with_condition=*/false));
      if (p.IsName("if")) {
        p.Next();
        node->exprs.push_back(p.Expression(false));
      }
      if (p.IsName("recursive")) p.Fail("recursive for loops are not supported");
      p.ExpectEnd();
      node->children.push_back(ParseBody({"else", "endfor"}, &end));
      if (end == "else") node->children.push_back(ParseBody({"endfor"}, &end));
    } else if (word == "set") {
      node->text = p.ExpectName();
      if (p.IsOp(".")) {
        p.Next();
        node->attribute = p.ExpectName();
      }
      if (p.IsOp("=")) {
        p.Next();
        node->kind = Node::Kind::kSet;
        node->exprs.push_back(p.Expression());
        p.ExpectEnd();
      } else {
        if (!node->attribute.empty()) p.Fail("block set of an attribute is not supported");
        p.ExpectEnd();
        node->kind = Node::Kind::kSetBlock;
        node->children.push_back(ParseBody({"endset"}, &end));
      }
    } else if (word == "macro") {
      node->kind = Node::Kind::kMacro;
      node->text = p.ExpectName();
      p.Expect("(");
      while (!p.IsOp(")")) {
        node->targets.push_back(p.ExpectName());
        if (p.IsOp("=")) {
          p.Next();
          node->exprs.push_back(p.Expression());
        } else {
          node->exprs.push_back(nullptr);
        }
        if (!p.IsOp(",")) break;
        p.Next();
      }
      p.Expect(")");
      p.ExpectEnd();
      node->children.push_back(ParseBody({"endmacro"}, &end));
    } else if (word == "break" || word == "continue") {
      node->kind = word == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      p.ExpectEnd();
    } else if (word == "generation") {
      // Hugging Face's AssistantTracker marks assistant text; rendering is unchanged.
      p.ExpectEnd();
      return ParseBody({"endgeneration"}, &end);
    } else {
      p.Fail(absl::StrCat("unknown tag '", word, "'"));
    }
    return node;
  }

  std::vector<Item> items_;
  size_t pos_ = 0;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Rendering.

// Code points of a UTF-8 string (Python indexes strings by code point).
std::vector<std::string> CodePoints(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    len = std::min(len, s.size() - i);
    out.push_back(s.substr(i, len));
    i += len;
  }
  return out;
}

int64_t Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString:
      return static_cast<int64_t>(CodePoints(v.AsString()).size());
    case Value::Kind::kList:
      return static_cast<int64_t>(v.AsList().size());
    case Value::Kind::kDict:
    case Value::Kind::kNamespace:
      return static_cast<int64_t>(v.AsDict().size());
    case Value::Kind::kUndefined:
      return 0;
    default:
      throw RenderError("object of type '" + v.TypeName() + "' has no len()");
  }
}

// Items a for loop (or a filter) iterates over.
List Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
      return v.AsList();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, item] : v.AsDict()) keys.push_back(Value::String(k));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (std::string& c : CodePoints(v.AsString())) chars.push_back(Value::String(std::move(c)));
      return chars;
    }
    case Value::Kind::kUndefined:
      return {};
    default:
      throw RenderError("'" + v.TypeName() + "' object is not iterable");
  }
}

void RequireDefined(const Value& v) {
  if (v.is_undefined()) {
    throw RenderError(v.AsString().empty() ? "an undefined value was used"
                                           : "'" + v.AsString() + "' is undefined");
  }
}

bool Less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.AsFloat() < b.AsFloat();
  if (a.is_string() && b.is_string()) return a.AsString() < b.AsString();
  if (a.is_list() && b.is_list()) {
    const List &x = a.AsList(), &y = b.AsList();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (Less(x[i], y[i])) return true;
      if (Less(y[i], x[i])) return false;
    }
    return x.size() < y.size();
  }
  RequireDefined(a);
  RequireDefined(b);
  throw RenderError("'<' not supported between instances of '" + a.TypeName() + "' and '" +
                    b.TypeName() + "'");
}

bool Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) throw RenderError("'in <string>' requires string as left operand");
      return container.AsString().find(item.AsString()) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& v : container.AsList()) {
        if (v.Equals(item)) return true;
      }
      return false;
    case Value::Kind::kDict:
    case Value::Kind::kNamespace:
      return item.is_string() && container.Find(item.AsString()) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    default:
      throw RenderError("argument of type '" + container.TypeName() + "' is not iterable");
  }
}

bool IsSpaceCodePoint(const std::string& c) {
  static const std::unordered_set<std::string> spaces = {" ",
                                                         "\t",
                                                         "\n",
                                                         "\r",
                                                         "\v",
                                                         "\f",
                                                         "\x1c",
                                                         "\x1d",
                                                         "\x1e",
                                                         "\x1f",
                                                         "\xc2\x85",
                                                         "\xc2\xa0",
                                                         "\xe1\x9a\x80",
                                                         "\xe2\x80\x80",
                                                         "\xe2\x80\x81",
                                                         "\xe2\x80\x82",
                                                         "\xe2\x80\x83",
                                                         "\xe2\x80\x84",
                                                         "\xe2\x80\x85",
                                                         "\xe2\x80\x86",
                                                         "\xe2\x80\x87",
                                                         "\xe2\x80\x88",
                                                         "\xe2\x80\x89",
                                                         "\xe2\x80\x8a",
                                                         "\xe2\x80\xa8",
                                                         "\xe2\x80\xa9",
                                                         "\xe2\x80\xaf",
                                                         "\xe2\x81\x9f",
                                                         "\xe3\x80\x80"};
  return spaces.count(c) > 0;
}

// Python str.strip / lstrip / rstrip; `chars` null: whitespace.
std::string Strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<std::string> cps = CodePoints(s);
  std::vector<std::string> strip_set;
  if (chars.is_string()) strip_set = CodePoints(chars.AsString());
  const auto strip = [&](const std::string& c) {
    return chars.is_string() ? std::find(strip_set.begin(), strip_set.end(), c) != strip_set.end()
                             : IsSpaceCodePoint(c);
  };
  size_t begin = 0, end = cps.size();
  if (left) {
    while (begin < end && strip(cps[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strip(cps[end - 1])) --end;
  }
  std::string out;
  for (size_t i = begin; i < end; ++i) out += cps[i];
  return out;
}

std::string AsciiCase(std::string s, bool upper) {
  for (char& c : s)
    c = upper ? std::toupper(static_cast<unsigned char>(c))
              : std::tolower(static_cast<unsigned char>(c));
  return s;
}

Value Split(const std::string& s, const Value& sep, int64_t max_split) {
  List parts;
  if (sep.is_none() || sep.is_undefined()) {
    std::vector<std::string> cps = CodePoints(s);
    size_t i = 0;
    while (true) {
      while (i < cps.size() && IsSpaceCodePoint(cps[i])) ++i;
      if (i >= cps.size()) break;
      std::string part;
      if (max_split >= 0 && static_cast<int64_t>(parts.size()) == max_split) {
        for (; i < cps.size(); ++i) part += cps[i];
        parts.push_back(Value::String(Strip(part, Value::None(), false, true)));
        break;
      }
      while (i < cps.size() && !IsSpaceCodePoint(cps[i])) part += cps[i++];
      parts.push_back(Value::String(part));
    }
    return Value::MakeList(std::move(parts));
  }
  const std::string& separator = sep.AsString();
  if (separator.empty()) throw RenderError("empty separator");
  size_t start = 0;
  while (true) {
    const size_t found = s.find(separator, start);
    if (found == std::string::npos ||
        (max_split >= 0 && static_cast<int64_t>(parts.size()) == max_split)) {
      parts.push_back(Value::String(s.substr(start)));
      break;
    }
    parts.push_back(Value::String(s.substr(start, found - start)));
    start = found + separator.size();
  }
  return Value::MakeList(std::move(parts));
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  if (from.empty()) throw RenderError("replace with an empty pattern is not supported");
  std::string out;
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t found = s.find(from, start);
    if (found == std::string::npos) break;
    out += s.substr(start, found - start) + to;
    start = found + from.size();
    ++done;
  }
  return out + s.substr(start);
}

class Renderer {
 public:
  enum class Flow { kNormal, kBreak, kContinue };

  Renderer(const Dict& globals, const RenderLimits& limits) : limits_(limits) {
    frames_.emplace_back();
    for (const auto& [k, v] : globals) frames_.back()[k] = v;
  }

  Flow Execute(const Node& node, std::string* out) {
    Step(1);
    const Nesting nesting(this);
    const Flow flow = ExecuteNode(node, out);
    CheckSize(*out);
    return flow;
  }

 private:
  // Counts `n` steps (statements run, loop iterations, list items made) against the limit.
  void Step(int64_t n) {
    if (n > limits_.max_steps - steps_) {
      throw RenderError(absl::StrCat("rendering took more than ", limits_.max_steps,
                                     " steps (loop iterations, statements, list items); "
                                     "a runaway template?"));
    }
    steps_ += n;
  }
  void CheckSize(const std::string& s) const { CheckBytes(s.size()); }
  void CheckBytes(uint64_t bytes) const {
    if (bytes > limits_.max_output_bytes) {
      throw RenderError(absl::StrCat("rendering made a string of more than ",
                                     limits_.max_output_bytes, " bytes; a runaway template?"));
    }
  }
  // One level of the renderer's recursion while alive (RenderLimits::max_depth).
  struct Nesting {
    explicit Nesting(Renderer* r) : renderer(r) {
      if (renderer->depth_ >= renderer->limits_.max_depth) {
        throw RenderError(
            absl::StrCat("template nests blocks, expressions and macro calls more "
                         "than ",
                         renderer->limits_.max_depth, " deep"));
      }
      ++renderer->depth_;
    }
    ~Nesting() { --renderer->depth_; }
    Renderer* renderer;
  };
  static void Checked(bool overflow, const std::string& op) {
    if (overflow) throw RenderError("integer overflow in " + op + " (beyond 64 bits)");
  }

  Flow ExecuteNode(const Node& node, std::string* out) {
    switch (node.kind) {
      case Node::Kind::kBody:
        for (const NodePtr& child : node.children) {
          const Flow flow = Execute(*child, out);
          if (flow != Flow::kNormal) return flow;
        }
        return Flow::kNormal;
      case Node::Kind::kText:
        *out += node.text;
        return Flow::kNormal;
      case Node::Kind::kOutput: {
        const Value v = Eval(*node.exprs[0]);
        *out += v.Str();
        return Flow::kNormal;
      }
      case Node::Kind::kIf:
        for (size_t i = 0; i < node.exprs.size(); ++i) {
          if (Eval(*node.exprs[i]).Truthy()) return Execute(*node.children[i], out);
        }
        if (node.children.size() > node.exprs.size()) return Execute(*node.children.back(), out);
        return Flow::kNormal;
      case Node::Kind::kFor:
        return ExecuteFor(node, out);
      case Node::Kind::kSet: {
        Value v = Eval(*node.exprs[0]);
        if (node.attribute.empty()) {
          frames_.back()[node.text] = std::move(v);
        } else {
          const Value target = Lookup(node.text);
          if (target.kind() != Value::Kind::kNamespace) {
            throw RenderError("cannot assign attribute on non-namespace object '" + node.text +
                              "'");
          }
          if (v.holds_namespace()) {
            // A namespace inside a namespace could come to contain itself.
            throw RenderError("cannot store a namespace in namespace attribute '" + node.text +
                              "." + node.attribute + "'");
          }
          Dict& dict = target.MutableDict();
          auto it = std::find_if(dict.begin(), dict.end(),
                                 [&](const auto& kv) { return kv.first == node.attribute; });
          if (it != dict.end()) {
            it->second = std::move(v);
          } else {
            dict.emplace_back(node.attribute, std::move(v));
          }
        }
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        std::string captured;
        Execute(*node.children[0], &captured);
        frames_.back()[node.text] = Value::String(captured);
        return Flow::kNormal;
      }
      case Node::Kind::kMacro: {
        const Node* macro = &node;
        frames_.back()[node.text] = Value::MakeCallable(
            [this, macro](CallArgs& args) { return CallMacro(*macro, args); }, node.text);
        return Flow::kNormal;
      }
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  Value CallMacro(const Node& macro, CallArgs& args) {
    if (call_depth_ >= limits_.max_call_depth) {
      throw RenderError(absl::StrCat("macro '", macro.text, "' called more than ",
                                     limits_.max_call_depth, " deep (unbounded recursion?)"));
    }
    ++call_depth_;
    struct Leave {
      int* depth;
      ~Leave() { --*depth; }
    } leave{&call_depth_};
    // A macro sees the template's top-level variables and its own arguments.
    std::vector<std::unordered_map<std::string, Value>> saved;
    saved.swap(frames_);
    frames_.push_back(saved.front());
    frames_.emplace_back();
    for (size_t i = 0; i < macro.targets.size(); ++i) {
      Value v = args.Get(i, macro.targets[i], Value::Undefined(macro.targets[i]));
      if (v.is_undefined() && macro.exprs[i]) v = Eval(*macro.exprs[i]);
      frames_.back()[macro.targets[i]] = v;
    }
    if (args.positional.size() > macro.targets.size()) {
      frames_.swap(saved);
      throw RenderError("macro '" + macro.text + "' takes not more than " +
                        std::to_string(macro.targets.size()) + " argument(s)");
    }
    std::string out;
    try {
      Execute(*macro.children[0], &out);
    } catch (...) {
      frames_.swap(saved);
      throw;
    }
    frames_.swap(saved);
    return Value::String(out);
  }

  Flow ExecuteFor(const Node& node, std::string* out) {
    List items = Iterate(Eval(*node.exprs[0]));
    if (node.exprs.size() > 1) {
      // The inline filter runs before loop.* is computed, with the loop variables bound.
      List kept;
      for (const Value& item : items) {
        Step(1);
        frames_.emplace_back();
        Bind(node.targets, item);
        if (Eval(*node.exprs[1]).Truthy()) kept.push_back(item);
        frames_.pop_back();
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (node.children.size() > 1) {
        frames_.emplace_back();
        const Flow flow = Execute(*node.children[1], out);
        frames_.pop_back();
        (void)flow;
      }
      return Flow::kNormal;
    }
    frames_.emplace_back();
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      Step(1);
      Bind(node.targets, items[i]);
      Dict loop = {{"index", Value::Int(i + 1)},
                   {"index0", Value::Int(i)},
                   {"revindex", Value::Int(n - i)},
                   {"revindex0", Value::Int(n - i - 1)},
                   {"first", Value::Bool(i == 0)},
                   {"last", Value::Bool(i == n - 1)},
                   {"length", Value::Int(n)},
                   {"depth", Value::Int(1)},
                   {"depth0", Value::Int(0)},
                   {"previtem", i > 0 ? items[i - 1] : Value::Undefined("previtem")},
                   {"nextitem", i + 1 < n ? items[i + 1] : Value::Undefined("nextitem")}};
      frames_.back()["loop"] = Value::MakeDict(std::move(loop));
      const Flow flow = Execute(*node.children[0], out);
      if (flow == Flow::kBreak) break;
    }
    frames_.pop_back();
    return Flow::kNormal;
  }

  void Bind(const std::vector<std::string>& targets, const Value& item) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = item;
      return;
    }
    const List parts = Iterate(item);
    if (parts.size() != targets.size()) {
      throw RenderError("cannot unpack " + std::to_string(parts.size()) + " values into " +
                        std::to_string(targets.size()) + " loop variables");
    }
    for (size_t i = 0; i < targets.size(); ++i) frames_.back()[targets[i]] = parts[i];
  }

  Value Lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto found = it->find(name);
      if (found != it->end()) return found->second;
    }
    return Value::Undefined(name);
  }

  Value Global(const std::string& name) {
    if (name == "range") {
      return Value::MakeCallable(
          [this](CallArgs& a) {
            int64_t start = 0, stop, step = 1;
            if (a.positional.size() == 1) {
              stop = a.positional[0].AsInt();
            } else if (a.positional.size() >= 2) {
              start = a.positional[0].AsInt();
              stop = a.positional[1].AsInt();
              if (a.positional.size() > 2) step = a.positional[2].AsInt();
            } else {
              throw RenderError("range expected at least 1 argument");
            }
            if (step == 0) throw RenderError("range() arg 3 must not be zero");
            // Items: ceil((stop - start) / step) where positive, in 128 bits (no overflow).
            const __int128 span = static_cast<__int128>(stop) - start;
            __int128 count = 0;
            if (step > 0 && span > 0) count = (span + step - 1) / step;
            if (step < 0 && span < 0) count = (-span + (-static_cast<__int128>(step)) - 1) /
                                              (-static_cast<__int128>(step));
            Step(count > limits_.max_steps ? limits_.max_steps + 1 : static_cast<int64_t>(count));
            List out;
            out.reserve(static_cast<size_t>(count));
            for (__int128 k = 0; k < count; ++k)
              out.push_back(Value::Int(static_cast<int64_t>(start + k * step)));
            return Value::MakeList(std::move(out));
          },
          name);
    }
    if (name == "namespace") {
      return Value::MakeCallable(
          [](CallArgs& a) {
            Dict attrs;
            for (const Value& p : a.positional) {
              if (p.is_mapping()) attrs.insert(attrs.end(), p.AsDict().begin(), p.AsDict().end());
            }
            for (const auto& kv : a.keyword) attrs.push_back(kv);
            return Value::MakeNamespace(std::move(attrs));
          },
          name);
    }
    if (name == "raise_exception") {
      return Value::MakeCallable(
          [](CallArgs& a) -> Value { throw RenderError(a.Get(0, "message").Str()); }, name);
    }
    if (name == "strftime_now") {
      return Value::MakeCallable(
          [](CallArgs& a) {
            const std::time_t now = std::time(nullptr);
            std::tm local;
            localtime_r(&now, &local);
            char buf[256];
            const size_t n =
                std::strftime(buf, sizeof(buf), a.Get(0, "format").Str().c_str(), &local);
            return Value::String(std::string(buf, n));
          },
          name);
    }
    return Value::Undefined(name);
  }

  CallArgs EvalArgs(const Expr& e, size_t first) {
    CallArgs args;
    const size_t keyword_start = e.args.size() - e.keyword_names.size();
    for (size_t i = first; i < e.args.size(); ++i) {
      Value v = Eval(*e.args[i]);
      if (i < keyword_start) {
        args.positional.push_back(std::move(v));
      } else {
        args.keyword.emplace_back(e.keyword_names[i - keyword_start], std::move(v));
      }
    }
    return args;
  }

  static Value Item(const Value& obj, const Value& key) {
    if (obj.is_mapping()) {
      if (!key.is_string()) return Value::Undefined();
      const Value* v = obj.Find(key.AsString());
      return v ? *v : Value::Undefined(key.AsString());
    }
    if (obj.is_list() || obj.is_string()) {
      if (key.kind() != Value::Kind::kInt && key.kind() != Value::Kind::kBool)
        return Value::Undefined();
      const bool is_list = obj.is_list();
      std::vector<std::string> cps;
      if (!is_list) cps = CodePoints(obj.AsString());
      const int64_t n =
          is_list ? static_cast<int64_t>(obj.AsList().size()) : static_cast<int64_t>(cps.size());
      int64_t i = key.AsInt();
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::Undefined();
      return is_list ? obj.AsList()[i] : Value::String(cps[i]);
    }
    RequireDefined(obj);
    return Value::Undefined();
  }

  Value Slice(const Value& obj, const Expr& e) {
    std::optional<int64_t> bounds[3];
    for (int k = 0; k < 3; ++k) {
      if (e.args[k + 1]) {
        Value v = Eval(*e.args[k + 1]);
        if (!v.is_none()) bounds[k] = v.AsInt();
      }
    }
    const int64_t step = bounds[2].value_or(1);
    if (step == 0) throw RenderError("slice step cannot be zero");
    std::vector<Value> seq;
    const bool is_string = obj.is_string();
    if (is_string) {
      for (std::string& c : CodePoints(obj.AsString())) seq.push_back(Value::String(std::move(c)));
    } else if (obj.is_list()) {
      seq = obj.AsList();
    } else {
      RequireDefined(obj);
      throw RenderError("'" + obj.TypeName() + "' object is not subscriptable");
    }
    const int64_t n = static_cast<int64_t>(seq.size());
    // Python's slice.indices().
    const auto clamp = [&](std::optional<int64_t> b, int64_t dflt) {
      if (!b) return dflt;
      int64_t v = *b < 0 ? *b + n : *b;
      if (step > 0) return std::clamp<int64_t>(v, 0, n);
      return std::clamp<int64_t>(v, -1, n - 1);
    };
    const int64_t start = clamp(bounds[0], step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(bounds[1], step > 0 ? n : -1);
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(seq[i]);
    if (is_string) {
      std::string s;
      for (const Value& c : out) s += c.AsString();
      return Value::String(s);
    }
    return Value::MakeList(std::move(out));
  }

  // obj.name(...) for Python's str, dict and list methods; nullopt when `name` is none of them.
  std::optional<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& a) {
    if (obj.is_string()) {
      const std::string& s = obj.AsString();
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        return Value::String(
            Strip(s, a.Get(0, "chars", Value::None()), name != "rstrip", name != "lstrip"));
      }
      if (name == "split")
        return Split(s, a.Get(0, "sep", Value::None()),
                     a.Get(1, "maxsplit", Value::Int(-1)).AsInt());
      if (name == "startswith" || name == "endswith") {
        const Value arg = a.Get(0, "prefix");
        List options = arg.is_list() ? arg.AsList() : List{arg};
        for (const Value& o : options) {
          if (!o.is_string()) throw RenderError(name + " first arg must be str or a tuple of str");
          const std::string& t = o.AsString();
          if (t.size() <= s.size() &&
              (name == "startswith" ? s.compare(0, t.size(), t) == 0
                                    : s.compare(s.size() - t.size(), t.size(), t) == 0)) {
            return Value::Bool(true);
          }
        }
        return Value::Bool(false);
      }
      if (name == "upper" || name == "lower") return Value::String(AsciiCase(s, name == "upper"));
      if (name == "replace") {
        return Value::String(Replace(s, a.Get(0, "old").Str(), a.Get(1, "new").Str(),
                                     a.Get(2, "count", Value::Int(-1)).AsInt()));
      }
      if (name == "find") {
        const size_t found = s.find(a.Get(0, "sub").Str());
        if (found == std::string::npos) return Value::Int(-1);
        return Value::Int(static_cast<int64_t>(CodePoints(s.substr(0, found)).size()));
      }
      if (name == "count") {
        const std::string sub = a.Get(0, "sub").Str();
        int64_t count = 0;
        for (size_t p = s.find(sub); !sub.empty() && p != std::string::npos;
             p = s.find(sub, p + sub.size()))
          ++count;
        return Value::Int(count);
      }
      if (name == "join") {
        std::string out;
        bool first = true;
        for (const Value& v : Iterate(a.Get(0, "iterable"))) {
          if (!v.is_string())
            throw RenderError("sequence item: expected str instance, " + v.TypeName() + " found");
          out += (first ? "" : s) + v.AsString();
          first = false;
        }
        return Value::String(out);
      }
      if (name == "title" || name == "capitalize") {
        std::string out = AsciiCase(s, false);
        bool word_start = true;
        for (char& c : out) {
          const bool alpha = std::isalpha(static_cast<unsigned char>(c));
          if (alpha && word_start) c = std::toupper(static_cast<unsigned char>(c));
          if (name == "title") {
            word_start = !alpha;
          } else {
            word_start = false;
          }
        }
        return Value::String(out);
      }
      return std::nullopt;
    }
    if (obj.kind() == Value::Kind::kDict) {
      if (name == "get") {
        const Value key = a.Get(0, "key");
        const Value* v = key.is_string() ? obj.Find(key.AsString()) : nullptr;
        return v ? *v : a.Get(1, "default", Value::None());
      }
      if (name == "items" || name == "keys" || name == "values") {
        List out;
        for (const auto& [k, v] : obj.AsDict()) {
          if (name == "items") {
            out.push_back(Value::MakeList({Value::String(k), v}));
          } else {
            out.push_back(name == "keys" ? Value::String(k) : v);
          }
        }
        return Value::MakeList(std::move(out));
      }
      return std::nullopt;
    }
    if (obj.is_list()) {
      if (name == "index") {
        const Value x = a.Get(0, "value");
        for (size_t i = 0; i < obj.AsList().size(); ++i) {
          if (obj.AsList()[i].Equals(x)) return Value::Int(static_cast<int64_t>(i));
        }
        throw RenderError("value is not in list");
      }
      if (name == "count") {
        int64_t n = 0;
        for (const Value& v : obj.AsList()) n += v.Equals(a.Get(0, "value"));
        return Value::Int(n);
      }
    }
    return std::nullopt;
  }

  Value Attribute(const Value& obj, const std::string& name) {
    if (obj.is_mapping()) {
      const Value* v = obj.Find(name);
      return v ? *v : Value::Undefined(name);
    }
    RequireDefined(obj);
    return Value::Undefined(name);
  }

  Value Arithmetic(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") {
      Value r = Value::String(a.Str() + b.Str());
      CheckSize(r.AsString());
      return r;
    }
    RequireDefined(a);
    RequireDefined(b);
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        CheckBytes(a.AsString().size() + b.AsString().size());
        return Value::String(a.AsString() + b.AsString());
      }
      if (a.is_list() && b.is_list()) {
        Step(static_cast<int64_t>(a.AsList().size() + b.AsList().size()));
        List out = a.AsList();
        out.insert(out.end(), b.AsList().begin(), b.AsList().end());
        return Value::MakeList(std::move(out));
      }
    }
    if (op == "*" && (a.is_string() || a.is_list()) && b.kind() == Value::Kind::kInt) {
      const int64_t n = std::max<int64_t>(b.AsInt(), 0);
      if (a.is_string()) {
        const uint64_t len = a.AsString().size();
        if (len != 0 && static_cast<uint64_t>(n) > limits_.max_output_bytes / len) {
          CheckBytes(limits_.max_output_bytes + 1);
        }
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += a.AsString();
        return Value::String(out);
      }
      const int64_t len = static_cast<int64_t>(a.AsList().size());
      Step(len != 0 && n > limits_.max_steps / len ? limits_.max_steps + 1 : len * n);
      List out;
      for (int64_t i = 0; i < n; ++i)
        out.insert(out.end(), a.AsList().begin(), a.AsList().end());
      return Value::MakeList(std::move(out));
    }
    if (a.is_number() && b.is_number()) {
      const bool floats = a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat;
      const double x = a.AsFloat(), y = b.AsFloat();
      const int64_t i = a.AsInt(), j = b.AsInt();
      int64_t r = 0;
      if (op == "+") {
        if (floats) return Value::Float(x + y);
        Checked(__builtin_add_overflow(i, j, &r), op);
        return Value::Int(r);
      }
      if (op == "-") {
        if (floats) return Value::Float(x - y);
        Checked(__builtin_sub_overflow(i, j, &r), op);
        return Value::Int(r);
      }
      if (op == "*") {
        if (floats) return Value::Float(x * y);
        Checked(__builtin_mul_overflow(i, j, &r), op);
        return Value::Int(r);
      }
      if (op == "/") {
        if (y == 0) throw RenderError("division by zero");
        return Value::Float(x / y);
      }
      if (op == "//" || op == "%") {
        if (y == 0) throw RenderError("integer division or modulo by zero");
        if (floats) {
          const double q = std::floor(x / y);
          return op == "//" ? Value::Float(q) : Value::Float(x - q * y);
        }
        if (i == std::numeric_limits<int64_t>::min() && j == -1) Checked(true, op);
        int64_t q = i / j;
        if ((i % j != 0) && ((i < 0) != (j < 0))) --q;
        return op == "//" ? Value::Int(q) : Value::Int(i - q * j);
      }
      if (op == "**") {
        if (!floats && j >= 0) {
          // By squaring: at most 64 multiplications, each checked.
          int64_t result = 1, base = i;
          for (int64_t e = j; e > 0; e >>= 1) {
            if (e & 1) Checked(__builtin_mul_overflow(result, base, &result), op);
            if (e > 1) Checked(__builtin_mul_overflow(base, base, &base), op);
          }
          return Value::Int(result);
        }
        return Value::Float(std::pow(x, y));
      }
    }
    throw RenderError("unsupported operand type(s) for " + op + ": '" + a.TypeName() + "' and '" +
                      b.TypeName() + "'");
  }

  bool Test(const std::string& name, const Value& v, CallArgs& a) {
    const Value arg = a.Get(0, "other");
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "number") return v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kFloat;
    if (name == "integer") return v.kind() == Value::Kind::kInt;
    if (name == "float") return v.kind() == Value::Kind::kFloat;
    if (name == "boolean") return v.kind() == Value::Kind::kBool;
    if (name == "true") return v.kind() == Value::Kind::kBool && v.AsBool();
    if (name == "false") return v.kind() == Value::Kind::kBool && !v.AsBool();
    if (name == "mapping") return v.kind() == Value::Kind::kDict;
    if (name == "iterable")
      return v.is_list() || v.is_string() || v.kind() == Value::Kind::kDict || v.is_undefined();
    if (name == "sequence") return v.is_list() || v.is_string() || v.kind() == Value::Kind::kDict;
    if (name == "callable") return v.kind() == Value::Kind::kCallable;
    if (name == "odd" || name == "even") {
      if (v.kind() != Value::Kind::kInt) throw RenderError("odd/even test needs an integer");
      return (v.AsInt() % 2 != 0) == (name == "odd");
    }
    if (name == "divisibleby") return arg.AsInt() != 0 && v.AsInt() % arg.AsInt() == 0;
    if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") return v.Equals(arg);
    if (name == "ne" || name == "!=") return !v.Equals(arg);
    if (name == "lt" || name == "<") return Less(v, arg);
    if (name == "gt" || name == ">") return Less(arg, v);
    if (name == "le" || name == "<=") return !Less(arg, v);
    if (name == "ge" || name == ">=") return !Less(v, arg);
    if (name == "in") return Contains(arg, v);
    if (name == "lower" || name == "upper")
      return v.is_string() && AsciiCase(v.AsString(), name == "upper") == v.AsString();
    throw RenderError("no test named '" + name + "'");
  }

  Value AttributeOf(const Value& item, const std::string& path) {
    Value v = item;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      v = Attribute(v,
                    path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
      if (dot == std::string::npos) return v;
      start = dot + 1;
    }
  }

  Value Filter(const std::string& name, const Value& v, CallArgs& a) {
    if (name == "length" || name == "count") return Value::Int(Length(v));
    if (name == "string") return Value::String(v.Str());
    if (name == "safe") return v;
    if (name == "tojson") {
      const Value indent = a.Get(0, "indent", Value::None());
      const Value separators = a.Get(2, "separators", Value::None());
      std::string item_sep = indent.is_none() ? ", " : ",", key_sep = ": ";
      if (separators.is_list() && separators.AsList().size() == 2) {
        item_sep = separators.AsList()[0].Str();
        key_sep = separators.AsList()[1].Str();
      }
      return Value::String(
          PythonJsonDumps(v, indent.is_none() ? -1 : static_cast<int>(indent.AsInt()), item_sep,
                          key_sep, a.Get(3, "sort_keys", Value::Bool(false)).Truthy()));
    }
    if (name == "trim") {
      RequireDefined(v);
      return Value::String(Strip(v.Str(), a.Get(0, "chars", Value::None()), true, true));
    }
    if (name == "upper" || name == "lower")
      return Value::String(AsciiCase(v.Str(), name == "upper"));
    if (name == "capitalize" || name == "title") {
      CallArgs none;
      return *CallMethod(Value::String(v.Str()), name, none);
    }
    if (name == "default" || name == "d") {
      const bool boolean = a.Get(1, "boolean", Value::Bool(false)).Truthy();
      if (v.is_undefined() || (boolean && !v.Truthy()))
        return a.Get(0, "default_value", Value::String(""));
      return v;
    }
    if (name == "join") {
      const std::string sep = a.Get(0, "d", Value::String("")).Str();
      const Value attribute = a.Get(1, "attribute", Value::None());
      std::string out;
      bool first = true;
      for (const Value& item : Iterate(v)) {
        out += (first ? "" : sep) +
               (attribute.is_none() ? item : AttributeOf(item, attribute.Str())).Str();
        first = false;
      }
      return Value::String(out);
    }
    if (name == "first" || name == "last") {
      const List items = Iterate(v);
      if (items.empty()) return Value::Undefined();
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::MakeList(Iterate(v));
    if (name == "items") {
      CallArgs none;
      if (v.is_undefined()) return Value::MakeList({});
      // Jinja2 raises TypeError on anything but a mapping (CallMethod has no items() for it).
      if (v.kind() != Value::Kind::kDict) {
        throw RenderError("Can only get item pairs from a mapping, not '" + v.TypeName() + "'");
      }
      return *CallMethod(v, "items", none);
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<std::string> cps = CodePoints(v.AsString());
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value::String(out);
      }
      List items = Iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::MakeList(std::move(items));
    }
    if (name == "replace") {
      return Value::String(
          Replace(v.Str(), a.Get(0, "old").Str(), a.Get(1, "new").Str(),
                  a.Get(2, "count", Value::None()).is_none() ? -1 : a.Get(2, "count").AsInt()));
    }
    if (name == "int") {
      if (v.is_number()) return Value::Int(v.AsInt());
      try {
        return Value::Int(std::stoll(v.Str()));
      } catch (...) {
        return a.Get(0, "default", Value::Int(0));
      }
    }
    if (name == "float") {
      if (v.is_number()) return Value::Float(v.AsFloat());
      try {
        return Value::Float(std::stod(v.Str()));
      } catch (...) {
        return a.Get(0, "default", Value::Float(0));
      }
    }
    if (name == "abs")
      return v.kind() == Value::Kind::kFloat ? Value::Float(std::fabs(v.AsFloat()))
                                             : Value::Int(std::llabs(v.AsInt()));
    if (name == "round") {
      const int64_t precision = a.Get(0, "precision", Value::Int(0)).AsInt();
      const double scale = std::pow(10.0, static_cast<double>(precision));
      return Value::Float(std::nearbyint(v.AsFloat() * scale) / scale);
    }
    if (name == "sum") {
      Value total = a.Get(1, "start", Value::Int(0));
      for (const Value& item : Iterate(v)) total = Arithmetic("+", total, item);
      return total;
    }
    if (name == "min" || name == "max") {
      const List items = Iterate(v);
      if (items.empty()) return Value::Undefined();
      Value best = items[0];
      for (const Value& item : items) {
        if (name == "min" ? Less(item, best) : Less(best, item)) best = item;
      }
      return best;
    }
    if (name == "unique") {
      List out;
      for (const Value& item : Iterate(v)) {
        if (!Contains(Value::MakeList(out), item)) out.push_back(item);
      }
      return Value::MakeList(std::move(out));
    }
    if (name == "sort" || name == "dictsort") {
      CallArgs none;
      if (name == "dictsort" && v.kind() != Value::Kind::kDict) {  // Jinja2: value.items() fails
        throw RenderError("'" + v.TypeName() + "' object has no attribute 'items'");
      }
      List items = name == "dictsort" ? CallMethod(v, "items", none)->AsList() : Iterate(v);
      const bool reverse = a.Get(0, "reverse", Value::Bool(false)).Truthy();
      const Value attribute = a.Get(2, "attribute", Value::None());
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        const Value kx = attribute.is_none() ? (name == "dictsort" ? x.AsList()[0] : x)
                                             : AttributeOf(x, attribute.Str());
        const Value ky = attribute.is_none() ? (name == "dictsort" ? y.AsList()[0] : y)
                                             : AttributeOf(y, attribute.Str());
        return reverse ? Less(ky, kx) : Less(kx, ky);
      });
      return Value::MakeList(std::move(items));
    }
    if (name == "map") {
      const Value attribute = a.Get(99, "attribute", Value::None());
      List out;
      for (const Value& item : Iterate(v)) {
        if (!attribute.is_none()) {
          Value got = AttributeOf(item, attribute.Str());
          if (got.is_undefined()) got = a.Get(99, "default", got);
          out.push_back(got);
        } else {
          CallArgs inner;
          inner.positional.assign(a.positional.begin() + std::min<size_t>(1, a.positional.size()),
                                  a.positional.end());
          if (a.positional.empty()) throw RenderError("map needs a filter name or attribute=");
          const std::string filter = a.positional[0].Str();
          if (!KnownFilters().count(filter)) throw RenderError("no filter named '" + filter + "'");
          out.push_back(Filter(filter, item, inner));
        }
      }
      return Value::MakeList(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool want = name == "select" || name == "selectattr";
      const size_t test_index = by_attr ? 1 : 0;
      List out;
      for (const Value& item : Iterate(v)) {
        const Value subject = by_attr ? AttributeOf(item, a.Get(0, "attribute").Str()) : item;
        bool pass;
        if (a.positional.size() > test_index) {
          CallArgs test_args;
          test_args.positional.assign(a.positional.begin() + test_index + 1, a.positional.end());
          pass = Test(a.positional[test_index].Str(), subject, test_args);
        } else {
          pass = subject.Truthy();
        }
        if (pass == want) out.push_back(item);
      }
      return Value::MakeList(std::move(out));
    }
    if (name == "indent") {
      const int64_t width = a.Get(0, "width", Value::Int(4)).AsInt();
      const bool first = a.Get(1, "first", Value::Bool(false)).Truthy();
      const bool blank = a.Get(2, "blank", Value::Bool(false)).Truthy();
      const std::string pad(static_cast<size_t>(width), ' ');
      const std::string s = v.Str();
      std::string out;
      size_t start = 0;
      bool first_line = true;
      while (true) {
        const size_t nl = s.find('\n', start);
        const std::string line =
            s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
        const bool pad_line = first_line ? first : (blank || !line.empty());
        out += (pad_line ? pad : "") + line;
        if (nl == std::string::npos) break;
        out += "\n";
        start = nl + 1;
        first_line = false;
      }
      return Value::String(out);
    }
    if (name == "wordcount") {
      return Value::Int(static_cast<int64_t>(Split(v.Str(), Value::None(), -1).AsList().size()));
    }
    if (name == "e" || name == "escape") {
      std::string out;
      for (const char c : v.Str()) {
        switch (c) {
          case '&':
            out += "&amp;";
            break;
          case '<':
            out += "&lt;";
            break;
          case '>':
            out += "&gt;";
            break;
          case '"':
            out += "&#34;";
            break;
          case '\'':
            out += "&#39;";
            break;
          default:
            out.push_back(c);
        }
      }
      return Value::String(out);
    }
    throw RenderError("no filter named '" + name + "'");
  }

 public:
  Value Eval(const Expr& e) {
    const Nesting nesting(this);
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName: {
        Value v = Lookup(e.name);
        return v.is_undefined() ? Global(e.name) : v;
      }
      case Expr::Kind::kGetAttr:
        return Attribute(Eval(*e.args[0]), e.name);
      case Expr::Kind::kGetItem:
        return Item(Eval(*e.args[0]), Eval(*e.args[1]));
      case Expr::Kind::kSlice:
        return Slice(Eval(*e.args[0]), e);
      case Expr::Kind::kCall: {
        const Expr& callee = *e.args[0];
        CallArgs args = EvalArgs(e, 1);
        if (callee.kind == Expr::Kind::kGetAttr) {
          const Value obj = Eval(*callee.args[0]);
          if (std::optional<Value> result = CallMethod(obj, callee.name, args)) return *result;
          const Value fn = Attribute(obj, callee.name);
          if (fn.kind() == Value::Kind::kCallable) return fn.AsCallable()(args);
          throw RenderError("'" + obj.TypeName() + "' object has no callable attribute '" +
                            callee.name + "'");
        }
        const Value fn = Eval(callee);
        if (fn.kind() != Value::Kind::kCallable) {
          RequireDefined(fn);
          throw RenderError("'" + fn.TypeName() + "' object is not callable");
        }
        return fn.AsCallable()(args);
      }
      case Expr::Kind::kFilter: {
        const Value v = Eval(*e.args[0]);
        CallArgs args = EvalArgs(e, 1);
        return Filter(e.name, v, args);
      }
      case Expr::Kind::kTest: {
        const Value v = Eval(*e.args[0]);
        CallArgs args = EvalArgs(e, 1);
        return Value::Bool(Test(e.name, v, args) != e.negated);
      }
      case Expr::Kind::kNot:
        return Value::Bool(!Eval(*e.args[0]).Truthy());
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        const Value v = Eval(*e.args[0]);
        if (!v.is_number())
          throw RenderError("bad operand type for unary -: '" + v.TypeName() + "'");
        if (e.kind == Expr::Kind::kPos) return v;
        if (v.kind() == Value::Kind::kFloat) return Value::Float(-v.AsFloat());
        if (v.AsInt() == std::numeric_limits<int64_t>::min()) Checked(true, "unary -");
        return Value::Int(-v.AsInt());
      }
      case Expr::Kind::kBinary:
        return Arithmetic(e.name, Eval(*e.args[0]), Eval(*e.args[1]));
      case Expr::Kind::kCompare: {
        Value left = Eval(*e.args[0]);
        for (size_t i = 0; i < e.compare_ops.size(); ++i) {
          Value right = Eval(*e.args[i + 1]);
          const std::string& op = e.compare_ops[i];
          bool result;
          if (op == "==") {
            result = left.Equals(right);
          } else if (op == "!=") {
            result = !left.Equals(right);
          } else if (op == "<") {
            result = Less(left, right);
          } else if (op == ">") {
            result = Less(right, left);
          } else if (op == "<=") {
            result = !Less(right, left);
          } else if (op == ">=") {
            result = !Less(left, right);
          } else if (op == "in") {
            result = Contains(right, left);
          } else {
            result = !Contains(right, left);
          }
          if (!result) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::Kind::kAnd: {
        Value left = Eval(*e.args[0]);
        return left.Truthy() ? Eval(*e.args[1]) : left;
      }
      case Expr::Kind::kOr: {
        Value left = Eval(*e.args[0]);
        return left.Truthy() ? left : Eval(*e.args[1]);
      }
      case Expr::Kind::kCondition:
        if (Eval(*e.args[1]).Truthy()) return Eval(*e.args[0]);
        return e.args.size() > 2 ? Eval(*e.args[2]) : Value::Undefined();
      case Expr::Kind::kList: {
        List items;
        for (const ExprPtr& item : e.args) items.push_back(Eval(*item));
        return Value::MakeList(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict items;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const Value key = Eval(*e.args[i]);
          if (!key.is_string())
            throw RenderError("only string keys are supported in dict literals");
          auto it = std::find_if(items.begin(), items.end(),
                                 [&](const auto& kv) { return kv.first == key.AsString(); });
          if (it != items.end()) {
            it->second = Eval(*e.args[i + 1]);
          } else {
            items.emplace_back(key.AsString(), Eval(*e.args[i + 1]));
          }
        }
        return Value::MakeDict(std::move(items));
      }
    }
    return Value();
  }

 private:
  std::vector<std::unordered_map<std::string, Value>> frames_;
  RenderLimits limits_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
  int depth_ = 0;  // Nesting levels open
};

}  // namespace

absl::StatusOr<Template> Template::Parse(std::string_view source) {
  try {
    TemplateParser parser(Lex(source));
    Template t;
    t.root_ = parser.ParseAll();
    return t;
  } catch (const SyntaxError& e) {
    return absl::InvalidArgumentError(absl::StrCat("chat template syntax error: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("chat template syntax error: ", e.what()));
  }
}

absl::StatusOr<std::string> Template::Render(const Dict& globals,
                                             const RenderLimits& limits) const {
  try {
    Renderer renderer(globals, limits);
    std::string out;
    renderer.Execute(*root_, &out);
    return out;
  } catch (const RenderError& e) {
    return absl::InvalidArgumentError(absl::StrCat("chat template: ", e.what()));
  } catch (const std::exception& e) {
    // Not a template's fault we foresaw (e.g. memory): still an error, never an escape.
    return absl::InternalError(absl::StrCat("chat template: rendering failed: ", e.what()));
  }
}

}  // namespace mlaserve::jinja
