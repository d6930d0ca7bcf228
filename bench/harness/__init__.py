"""What every benchmark script shares: the server under test (`server`), an OpenAI client with token
timing (`http`), the machine it ran on (`machine`) and the stamped report (`report`)."""
