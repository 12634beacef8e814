"""The front end: a `.mha` source -> a checked program (`check.CheckedProgram`).

Sources are read (`sources`) and parsed with the grammar (`parse` -> `ast`), then checked
(`check`: names, types, the rules of each method, what the kernel designs can run), with
every mistake a located diagnostic (`diagnostics`). `types`, `semantics` and
`builtin_functions` say what the language's names mean; `attention_spec` resolves an
attention declaration's settings.
"""
