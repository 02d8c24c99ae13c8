// A Spark WebSocket conversation from Node with the `ws` package (npm install ws).
//   SPARK_SERVER=http://127.0.0.1:9990 node examples/spark_ws.js
const WebSocket = require("ws");

const url = (process.env.SPARK_SERVER || "http://127.0.0.1:9990").replace(/^http/, "ws") + "/turing/v3/gpt";
const ws = new WebSocket(url);
ws.on("open", () => ws.send(JSON.stringify({
  header: {traceId: "example"},
  parameter: {chat: {max_tokens: 24, top_k: 1}},
  payload: {message: {text: [{role: "user", content: "What is the capital of France?"}]}},
})));
ws.on("message", (data) => {
  const frame = JSON.parse(data);
  if (frame.header.code !== 0) {
    console.error(`error ${frame.header.code}: ${frame.header.message}`);
    process.exitCode = 1;
    return;
  }
  process.stdout.write(frame.payload.choices.text[0].content);
  if (frame.header.status === 2) process.stdout.write("\n");
});
ws.on("error", (err) => { console.error(err.message); process.exitCode = 1; });
