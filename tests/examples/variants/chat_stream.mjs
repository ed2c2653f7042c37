// The chat page's JavaScript example, streamed: once without usage, once with include_usage.
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: "https://api.bricksum.com/v1",
  apiKey: process.env.KILN_API_KEY,
});

for (const include_usage of [false, true]) {
  const stream = await client.chat.completions.create({
    model: "qwen3-32b",
    messages: [
      { role: "system", content: "Answer briefly." },
      { role: "user", content: "Hello!" },
    ],
    max_tokens: 800,
    stream: true,
    stream_options: { include_usage },
  });
  let text = "";
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) text += chunk.choices[0].delta.content ?? "";
    if (chunk.usage) usage = chunk.usage;
  }
  console.log(text);
  console.log(JSON.stringify(usage));
}
