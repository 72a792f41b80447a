"""The tests, as packages: unit/<package>/ mirrors sglang_pdd's packages, e2e/ runs real SGLang
servers, support/ holds the fakes and helpers that tests and benchmarks import
(``from tests.support.fake_backends import Fakes``); docs/testing.md says where a new test goes."""
