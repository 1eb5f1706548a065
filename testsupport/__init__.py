"""What the tests and the benches share: the stub and gateway as processes or in-process
servers, Redis, the load client, the stream grammars and the chaos runs. It imports neither
`tests` nor `bench`, so that they never import each other; it ships in no package."""
