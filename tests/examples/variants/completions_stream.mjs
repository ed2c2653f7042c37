// The completions page's JavaScript example, streamed with include_usage.
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: "https://api.bricksum.com/v1",
  apiKey: process.env.KILN_API_KEY,
});

const stream = await client.completions.create({
  model: "qwen3-32b",
  prompt: "The capital of France is",
  max_tokens: 32,
  stream: true,
  stream_options: { include_usage: true },
});
let text = "";
for await (const chunk of stream) {
  if (chunk.choices.length) text += chunk.choices[0].text;
  if (chunk.usage) {
    console.log(text);
    console.log(JSON.stringify(chunk.usage));
  }
}
