// Values of the Jinja subset: Python's data model as chat templates see it (None, bool, int,
// float, str, list, dict with insertion order, plus Jinja's Undefined, namespace() objects and
// callables such as macros).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace mlaserve::jinja {

// A template failed while rendering; the message is shown to the user as is.
class RenderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
using List = std::vector<Value>;
// Python dicts keep insertion order; chat template dicts have string keys.
using Dict = std::vector<std::pair<std::string, Value>>;
struct CallArgs;
using Callable = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable
  };

  Value() = default;  // Undefined
  static Value Undefined(std::string name = "") {
    Value v;
    v.string_ = std::move(name);
    return v;
  }
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b) {
    Value v(Kind::kBool);
    v.int_ = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value Float(double f) {
    Value v(Kind::kFloat);
    v.float_ = f;
    return v;
  }
  static Value String(std::string s) {
    Value v(Kind::kString);
    v.string_ = std::move(s);
    return v;
  }
  static Value MakeList(List items) {
    Value v(Kind::kList);
    v.list_ = std::make_shared<List>(std::move(items));
    return v;
  }
  static Value MakeDict(Dict items) {
    Value v(Kind::kDict);
    v.dict_ = std::make_shared<Dict>(std::move(items));
    return v;
  }
  static Value MakeNamespace(Dict items) {
    Value v = MakeDict(std::move(items));
    v.kind_ = Kind::kNamespace;
    return v;
  }
  static Value MakeCallable(Callable fn, std::string name) {
    Value v(Kind::kCallable);
    v.callable_ = std::make_shared<Callable>(std::move(fn));
    v.string_ = std::move(name);
    return v;
  }
  static Value FromJson(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_mapping() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

  bool AsBool() const { return int_ != 0; }
  int64_t AsInt() const { return kind_ == Kind::kFloat ? static_cast<int64_t>(float_) : int_; }
  double AsFloat() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& AsString() const { return string_; }  // also an Undefined's name
  const List& AsList() const { return *list_; }
  const Dict& AsDict() const { return *dict_; }
  Dict& MutableDict() const { return *dict_; }  // namespaces are shared and mutable
  const Callable& AsCallable() const { return *callable_; }

  // Python truthiness.
  bool Truthy() const;
  // Dict lookup; nullptr when absent.
  const Value* Find(const std::string& key) const;
  // Python str() of the value as Jinja prints it ("None", "True", "[1, 'a']"; Undefined: "").
  std::string Str() const;
  // Python repr().
  std::string Repr() const;
  // Python ==.
  bool Equals(const Value& other) const;
  std::string TypeName() const;

 private:
  explicit Value(Kind kind) : kind_(kind) {}
  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  std::string string_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> callable_;
};

// Positional and keyword arguments of a call.
struct CallArgs {
  List positional;
  Dict keyword;
  // Argument `index` or keyword `name`; `fallback` when neither was given.
  Value Get(size_t index, const std::string& name, Value fallback = Value()) const;
};

// Python's repr() of a float (shortest round-trip, "1.0", "1e-07", "1e+16", "inf", "nan").
std::string PythonFloatRepr(double value);

// json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...) as
// Hugging Face's tojson filter calls it. indent < 0: no indentation.
std::string PythonJsonDumps(const Value& value, int indent, const std::string& item_separator,
                            const std::string& key_separator, bool sort_keys);

}  // namespace mlaserve::jinja
