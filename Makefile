# payonce — the commands a newcomer needs. `make run` and `make test` are the
# two the README starts with; CI runs `make test` through .ci/run.

CARGO ?= cargo

.PHONY: run test fmt lint example clean

# Serve on 127.0.0.1:8080 with payonce.db in dev mode (a fixed, printed
# callback secret) and print what to try next.
run:
	$(CARGO) run --release --locked -- serve --db payonce.db --listen 127.0.0.1:8080 --dev --coupon NEW10 --points-per-yuan 1

# Unit, integration and doc tests, and the examples build.
test:
	$(CARGO) test --locked --all-targets
	$(CARGO) test --locked --doc

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --all-targets -- -D warnings

# Replays the 40 ms re-delivery incident in process and prints the effects.
example:
	$(CARGO) run --locked --example incident_replay

clean:
	$(CARGO) clean
