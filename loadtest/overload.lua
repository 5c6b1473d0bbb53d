-- wrk script run by loadtest/wrk.py (for the overload and front-end cost benches): a
-- closed-loop flood of /infer (or of the path given after `--`: /infer or /v1/embeddings)
-- with a rotating ~12-word sentence, each connection resending as soon as it has any answer
-- (429s included: what naive orchestrator retry loops do). Prints one RESULT line of JSON
-- with the counts by class and the latency percentiles of all answers. wrk leaves an answer
-- slower than its --timeout out of `latency` (and counts it in errors.timeout), so
-- loadtest/wrk.py sets that past the server's longest deadline.
local words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "a",
  "small", "bird", "sings", "near", "river", "bank", "under", "bright", "morning", "sun", "and",
  "children", "play", "games", "in", "green", "park"}
-- The field holding the text, by path.
local text_field = {["/infer"] = "inputs", ["/v1/embeddings"] = "input"}

local threads = {}
function setup(thread) table.insert(threads, thread) end

function init(args)
  ok, throttled, unavailable, server_error, other, next_body = 0, 0, 0, 0, 0, 0
  path = args[1] or "/infer"
  local field = text_field[path] or error("no request body for " .. path)
  bodies = {}
  math.randomseed(7)
  for i = 1, 256 do
    local sentence = {}
    for j = 1, 12 do sentence[j] = words[math.random(#words)] end
    bodies[i] = '{"' .. field .. '": "' .. table.concat(sentence, " ") .. '"}'
  end
end

function request()
  next_body = next_body % #bodies + 1
  return wrk.format("POST", path, {["Content-Type"] = "application/json"}, bodies[next_body])
end

function response(status, headers, body)
  if status >= 200 and status < 300 then ok = ok + 1
  elseif status == 429 then throttled = throttled + 1
  elseif status == 503 then unavailable = unavailable + 1
  elseif status >= 500 then server_error = server_error + 1
  else other = other + 1 end
end

function done(summary, latency, requests)
  local totals = {ok = 0, throttled = 0, unavailable = 0, server_error = 0, other = 0}
  for _, thread in ipairs(threads) do
    for name, _ in pairs(totals) do totals[name] = totals[name] + (thread:get(name) or 0) end
  end
  local e = summary.errors
  io.write(string.format(
    'RESULT {"seconds": %.3f, "ok": %d, "throttled": %d, "unavailable": %d, ' ..
    '"server_error": %d, "other": %d, "p50_ms": %.2f, "p99_ms": %.2f, "max_ms": %.2f, ' ..
    '"connect_errors": %d, "read_errors": %d, "write_errors": %d, "timeouts": %d}\n',
    summary.duration / 1e6, totals.ok, totals.throttled, totals.unavailable,
    totals.server_error, totals.other, latency:percentile(50) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000, e.connect, e.read, e.write, e.timeout))
end
