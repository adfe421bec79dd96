"""The servers: the HTTP client and its one error classifier, probes, the fleet preflight and its table, the
local llama.cpp fleet. Imports only core."""
