"""Operations tooling, imported only by the command (``switchyard``), the benches and the tests,
never by the runtime: the local stack (``stack``), the demo (``demo``), fault injection
(``chaos``) and the security check (``security``)."""
